"""Attack class: resources without a hard bound.

Under bwrap the work tree lives on a tmpfs whose size is the disk quota (``private_workdir``):
files unlinked while open and preallocated files count against it, an inode flood is seen,
and nothing the run writes reaches the host's disk. Each attack runs at the import of the code
under test (the candidate left ``half`` unfixed) and must end ``failed`` or
``resource_killed`` on every mechanism where the bound applies (bwrap, with and without
cgroups), with nothing written outside the run.
"""

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execution_helpers import (  # noqa: E402
    FIX,
    LIMITS,
    MECHANISMS,
    assert_blocked,
    payload,
    verify,
)

BWRAP = [m for m in MECHANISMS if m.startswith("bwrap")]
MiB = 1 << 20
QUOTA = LIMITS.disk_bytes // MiB  # 32 MiB

ATTACKS = {
    # Unlinked while open: invisible to a walk of the tree, still on the tmpfs.
    "unlinked_while_open": (
        "import os, time\n"
        "held = []\n"
        "try:\n"
        "    for k in range(4):  # each file below the per-file cap, together twice the quota\n"
        "        f = open(f'big{k}', 'wb')\n"
        "        os.unlink(f'big{k}')\n"
        "        held.append(f)\n"
        f"        for _ in range({QUOTA // 2 - 1}):\n"
        "            f.write(b'x' * (1 << 20))\n"
        "        f.flush()\n"
        "except OSError:\n    pass\n"
        "time.sleep(3)\n"
    ),
    # Preallocated: the blocks are taken before a byte is written.
    "fallocate_past_the_quota": (
        "import os\n"
        "for i in range(4):\n"
        "    fd = os.open(f'pre{i}', os.O_CREAT | os.O_WRONLY)\n"
        f"    os.posix_fallocate(fd, 0, {QUOTA // 3} << 20)\n"
    ),
    # Many files each below the per-file cap.
    "many_files_below_the_file_cap": (
        "import os\n"
        f"for i in range({QUOTA + 8}):\n"
        "    with open(f'f{i}', 'wb') as f:\n"
        "        f.write(b'x' * (1 << 20))\n"
    ),
    # An inode flood: empty files take no blocks.
    "inode_flood": (
        "import os, time\n"
        "os.mkdir('many')\n"
        f"for i in range({LIMITS.disk_files + 2000}):\n"
        "    open(f'many/{i}', 'wb').close()\n"
        "time.sleep(3)\n"
    ),
    # Hard links of one big file (one set of blocks, many names) and a sparse file.
    "sparse_then_filled": (
        "import os\n"
        "with open('sparse', 'wb') as f:\n"
        f"    f.truncate({QUOTA // 2} << 20)\n"
        "with open('sparse', 'r+b') as f:\n"
        f"    for _ in range({QUOTA}):\n"
        "        f.write(b'y' * (1 << 20))\n"
    ),
    # The private /tmp and /dev/shm are size-capped tmpfs too.
    "tmp_filled": (
        "with open('/tmp/fill', 'wb') as f:\n"
        f"    for _ in range({2 * LIMITS.tmp_bytes // MiB}):\n"
        "        f.write(b'x' * (1 << 20))\n"
    ),
    "dev_shm_filled": (
        "with open('/dev/shm/fill', 'wb') as f:\n"
        f"    for _ in range({2 * LIMITS.shm_bytes // MiB}):\n"
        "        f.write(b'x' * (1 << 20))\n"
    ),
    # The host's copy of the tree is read-only under the private one.
    "host_tree_written": (
        "import glob\n"
        "for p in glob.glob('/.gagar-tree/**', recursive=True):\n"
        "    try:\n"
        "        open(p, 'a').write('x')\n"
        "    except OSError:\n"
        "        pass\n"
        "open('/.gagar-tree/new', 'w').write('x')\n"
    ),
    # Output flood past the per-file cap (stdout is a file).
    "output_flood": (
        "import os\n"
        f"for _ in range({2 * LIMITS.file_bytes // MiB}):\n"
        "    os.write(1, b'x' * (1 << 20))\n"
    ),
    # Memory past the cgroup limit / the address-space backstop.
    "memory_hog": f"x = bytearray({2 * LIMITS.memory_bytes})\nx[::4096] = b'1' * len(x[::4096])\n",
    # Processes until the cap, then the tests run on.
    "bounded_fork_flood": (
        "import os, time\n"
        "kids = []\n"
        "try:\n"
        f"    for _ in range({2 * LIMITS.nproc}):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        kids.append(pid)\n"
        "except OSError:\n    pass\n"
    ),
}

# Attacks whose bound is the private work tree (bwrap only); the rest hold on every mechanism.
DISK = {
    "unlinked_while_open",
    "fallocate_past_the_quota",
    "many_files_below_the_file_cap",
    "inode_flood",
    "sparse_then_filled",
    "tmp_filled",
    "dev_shm_filled",
    "host_tree_written",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
@pytest.mark.parametrize("mech", BWRAP)
def test_resource_attack_is_bounded(name, mech):
    v = verify(payload(ATTACKS[name], "res_mod"), mech)
    assert_blocked(v)
    assert v.sandbox is not None and "disk" in v.sandbox.isolation


@pytest.mark.parametrize("name", sorted(set(ATTACKS) - DISK))
@pytest.mark.parametrize("mech", [m for m in MECHANISMS if not m.startswith("bwrap")])
def test_resource_attack_without_bwrap(name, mech):
    assert_blocked(verify(payload(ATTACKS[name], "res_mod"), mech))


@pytest.mark.parametrize("name", ["unlinked_while_open", "inode_flood"])
def test_held_past_the_quota_is_resource_killed(name):
    v = verify(payload(ATTACKS[name], "res_mod"), BWRAP[0])
    assert v.status == "resource_killed" and "disk" in v.sandbox.limit_hits, v.test_log


def test_a_fix_that_writes_within_the_quota_passes():
    # Honest use of the tree: scratch files well under the quota do not fail a correct fix.
    code = "with open('scratch.bin', 'wb') as f:\n    f.write(b'x' * (4 << 20))\n"
    v = verify(payload(code, "res_mod", fixed=True), BWRAP[0])
    assert v.status == "passed", v.test_log


def test_the_quota_is_the_limit_not_the_host_disk():
    # The same fill with a larger quota passes (the bound is Limits.disk_bytes, nothing else).
    limits = dataclasses.replace(LIMITS, disk_bytes=96 * MiB, file_bytes=64 * MiB)
    code = ATTACKS["fallocate_past_the_quota"]
    v = verify(payload(code, "res_mod", fixed=True), BWRAP[0], limits=limits)
    assert v.status == "passed", v.test_log
    assert FIX  # the fix alone, for reference, passes in test_reporter_reachable
