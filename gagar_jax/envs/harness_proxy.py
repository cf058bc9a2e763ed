"""Runs inside the sandbox: a loopback port forwarded to the gateway's Unix socket, then the
harness as a child process.

    python3 harness_proxy.py SOCKET PORT -- HARNESS ARGV...

The sandbox has no network at all (its own network namespace holds only ``lo``); the gateway's
socket is bound into it read-only, so ``http://127.0.0.1:PORT`` is the one endpoint the harness
and the commands it runs can reach. Standard library only (it runs under the sandbox's
interpreter, not the trainer's). Exits with the harness's exit status.
"""

import asyncio
import os
import sys


async def _pipe(reader, writer):
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass


async def _main(sock_path: str, port: int, argv: list[str]) -> int:
    async def handle(client_r, client_w):
        try:
            up_r, up_w = await asyncio.open_unix_connection(sock_path)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        child = await asyncio.create_subprocess_exec(*argv, env=dict(os.environ))
        return await child.wait()


def main() -> int:
    if len(sys.argv) < 5 or sys.argv[3] != "--":
        print("usage: harness_proxy.py SOCKET PORT -- ARGV...", file=sys.stderr)
        return 2
    rc = asyncio.run(_main(sys.argv[1], int(sys.argv[2]), sys.argv[4:]))
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
