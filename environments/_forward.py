"""Run a command with loopback ports that lead to Unix sockets: a sandbox's one way out.

Runs inside a bubblewrap sandbox, under the host's system Python with the standard library
only (nothing of plies is importable there):

    python3 -I _forward.py 127.0.0.1:8000=/.plies/forward-0.sock ... -- COMMAND ARGS...

It listens on each loopback port first, so the command can connect from its first instant,
then runs the command with the same standard streams and exits with its status (128 + the
signal's number when a signal ended it). Each accepted connection is piped both ways to a
fresh connection on the matching socket, which the host bound into the sandbox. The sandbox's
network namespace holds nothing else, so an agent inside reaches the gateway at the URL it
would use outside, and nothing more.
"""

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable

_CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.write_eof()
        except (OSError, RuntimeError):
            writer.close()


def _handler(path: str) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """Accepted connections piped to fresh connections on the Unix socket `path`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(path)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()

    return handle


async def _main(forwards: list[tuple[str, int, str]], argv: list[str]) -> int:
    for host, port, path in forwards:
        await asyncio.start_server(_handler(path), host, port)
    process = await asyncio.create_subprocess_exec(*argv)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, process.send_signal, sig)
    code = await process.wait()
    return 128 - code if code < 0 else code


def _parse(spec: str) -> tuple[str, int, str]:
    address, _, path = spec.partition("=")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not path:
        raise SystemExit(f"forward: not HOST:PORT=SOCKET: {spec!r}")
    return host, int(port), path


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--" not in args or args.index("--") == len(args) - 1:
        raise SystemExit("usage: _forward.py HOST:PORT=SOCKET... -- COMMAND [ARGS...]")
    split = args.index("--")
    sys.exit(asyncio.run(_main([_parse(s) for s in args[:split]], args[split + 1 :])))
