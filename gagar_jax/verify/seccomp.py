"""A seccomp BPF program, built by hand, that keeps sandboxed code away from other processes.

The sandbox hands it to ``bwrap --seccomp FD`` (bwrap loads it into the command just before
``exec``; bwrap's own PID 1 is not filtered). It denies, with ``EPERM``, every system call that
reads, writes or steals from another process of the same uid:

  ptrace            attach to PID 1 and inject ``exit_group(0)`` (a failing run reports rc 0)
  process_vm_readv  read / write another process's memory without ptrace
  process_vm_writev
  pidfd_getfd       copy a file descriptor out of another process (the start marker, a report)
  kcmp              compare descriptors across processes (probes another process's fd table)

Everything else is allowed. The program checks the architecture first (a system call is only
decoded with the table of the architecture it was made for) and, on x86_64, refuses the x32 ABI
(system call numbers with bit 30 set), which would otherwise reach ``ptrace`` under another
number. Calls of any other architecture (e.g. i386 through ``int 0x80``) are refused outright.

Constants are the kernel's documented ABI: ``linux/seccomp.h``, ``linux/filter.h``,
``linux/audit.h`` and the syscall tables of ``arch/x86/entry/syscalls/syscall_64.tbl`` and
``include/uapi/asm-generic/unistd.h`` (aarch64).
"""

from __future__ import annotations

import errno
import functools
import os
import struct

# struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
_OFF_NR = 0
_OFF_ARCH = 4

# classic BPF opcodes (linux/filter.h)
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_KILL_PROCESS = 0x80000000

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp")
SYSCALLS = {
    "x86_64": {
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "pidfd_getfd": 438,
    },
    "aarch64": {
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "pidfd_getfd": 438,
    },
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    # struct sock_filter { __u16 code; __u8 jt; __u8 jf; __u32 k; } in host byte order.
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(machine: str) -> bytes:
    """The BPF program (``struct sock_filter[]`` bytes) for ``machine`` (``uname -m``).

    Raises:
      ValueError: for an architecture without a table here (the caller runs unfiltered and
        must say so).
    """
    if machine not in SYSCALLS:
        raise ValueError(
            f"no seccomp syscall table for architecture {machine!r} (known: {sorted(SYSCALLS)})"
        )
    table = SYSCALLS[machine]
    deny = SECCOMP_RET_ERRNO | errno.EPERM
    prog = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        _insn(_JEQ_K, 1, 0, AUDIT_ARCH[machine]),  # our architecture: skip the kill
        _insn(_RET_K, 0, 0, deny),  # another ABI (i386 via int 0x80): refused
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    if machine == "x86_64":
        prog += [_insn(_JGE_K, 0, 1, X32_SYSCALL_BIT), _insn(_RET_K, 0, 0, deny)]
    numbers = [table[name] for name in DENIED]
    for i, nr in enumerate(numbers):
        # Match: jump to the final "deny" (after the remaining checks and the allow).
        left = len(numbers) - i - 1
        prog.append(_insn(_JEQ_K, left + 1, 0, nr))
    prog += [_insn(_RET_K, 0, 0, SECCOMP_RET_ALLOW), _insn(_RET_K, 0, 0, deny)]
    return b"".join(prog)


@functools.cache
def host_filter() -> bytes | None:
    """The program for this machine, or None where no table exists (documented as such)."""
    try:
        return build_filter(os.uname().machine)
    except ValueError:
        return None


# --- exec control of the test process -----------------------------------------------------------
# ``seccomp(2)`` itself, and the calls the exec filter hands to the supervisor.
SECCOMP_NR = {"x86_64": 317, "aarch64": 277}
EXEC_SYSCALLS = {
    "x86_64": {"execve": 59, "execveat": 322},
    "aarch64": {"execve": 221, "execveat": 281},
}
SECCOMP_RET_USER_NOTIF = 0x7FC00000


def exec_notify_filter(machine: str) -> bytes:
    """A BPF program that hands every ``execve``/``execveat`` to a user-space supervisor.

    The test runner's supervisor installs it on itself with ``SECCOMP_FILTER_FLAG_NEW_LISTENER``
    before it forks the test process (so every process of the session inherits it and none can
    remove it) and answers each notification by the caller's thread group: an exec by the test
    process itself (any of its threads) is refused with ``EPERM``, an exec by any other process
    (a child the tests or the code forked) continues as if unfiltered. The kernel, not the
    process's name, decides who is calling. Calls of another ABI (x32 numbers, i386 through
    ``int 0x80``) are refused outright; every other call is allowed (the sandbox's own filter,
    :func:`build_filter`, still applies on top).

    Raises:
      ValueError: for an architecture without a table here.
    """
    if machine not in EXEC_SYSCALLS:
        raise ValueError(f"no exec syscall table for architecture {machine!r}")
    deny = SECCOMP_RET_ERRNO | errno.EPERM
    execve, execveat = EXEC_SYSCALLS[machine]["execve"], EXEC_SYSCALLS[machine]["execveat"]
    prog = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        _insn(_JEQ_K, 1, 0, AUDIT_ARCH[machine]),
        _insn(_RET_K, 0, 0, deny),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    if machine == "x86_64":
        prog += [_insn(_JGE_K, 0, 1, X32_SYSCALL_BIT), _insn(_RET_K, 0, 0, deny)]
    prog += [
        _insn(_JEQ_K, 2, 0, execve),  # -> notify
        _insn(_JEQ_K, 1, 0, execveat),  # -> notify
        _insn(_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        _insn(_RET_K, 0, 0, SECCOMP_RET_USER_NOTIF),
    ]
    return b"".join(prog)


def host_exec_filter() -> tuple[bytes, int] | None:
    """(the exec filter, the number of ``seccomp(2)``) for this machine, or None."""
    machine = os.uname().machine
    try:
        return exec_notify_filter(machine), SECCOMP_NR[machine]
    except ValueError:
        return None
