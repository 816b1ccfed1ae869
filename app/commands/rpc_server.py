"""`tandem rpc-server`: offer this machine's CPU to another machine's Tandem as llama.cpp
RPC device, so a target too big for one machine runs split over both.

The server (``tandem-rpc-server``, built by packaging/bootstrap.sh from
packaging/rpc_server.cpp against the same llama.cpp as the Python package) has no
authentication and no encryption: anyone who can connect can run computations and read
what is sent. It binds loopback unless told otherwise, and any other address gets a
loud warning; across machines, reach it through an SSH tunnel (README, "Several
machines").
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import socket
import sys
from pathlib import Path

from tandem.errors import TandemError
from tandem.runtime.backends.rpc_probe import DEFAULT_PORT
from tandem.runtime.machine import cpu_cores
from tandem.runtime.planning.hardware import MiB, format_size, parse_size

BINARY = "tandem-rpc-server"

WARNING = """\
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
  tandem rpc-server is listening on {host}, not on loopback.
  llama.cpp's RPC server has NO authentication and NO encryption: anyone who
  can reach {host}:{port} can use this machine's CPU and memory and read the
  model and activations sent to it. Use it only on a network you trust, or
  keep the default (127.0.0.1) and connect through an SSH tunnel:
      ssh -N -L {port}:127.0.0.1:{port} USER@THIS-MACHINE
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rpc-server", help="lend this machine's CPU to another machine's model (llama.cpp RPC)",
                       description="Serve this machine's CPU as a llama.cpp RPC device; the other machine runs "
                                   "`tandem run|chat|serve -m MODEL --rpc HOST:PORT`.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; the server has no authentication)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for computing (default: all cores)")
    p.add_argument("--mem", default=None, metavar="MB",
                   help="memory to offer, in MiB or with a unit (2GiB); default: what is available")
    p.add_argument("--cache", action="store_true", help="cache received weights on disk (faster reconnects)")
    p.set_defaults(func=run)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def find_binary() -> Path:
    """``$TANDEM_RPC_SERVER``, else beside this Python (bootstrap installs it into the
    venv's bin), else on ``PATH``."""
    env = os.environ.get("TANDEM_RPC_SERVER")
    candidates = [Path(env)] if env else [Path(sys.executable).parent / BINARY]
    found = shutil.which(BINARY)
    candidates += [Path(found)] if found else []
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise TandemError(f"{BINARY} is not built: run bash packaging/bootstrap.sh (it builds llama.cpp with "
                      "the RPC backend and this server), or set TANDEM_RPC_SERVER to its path.")


def mem_mib(text: str | None) -> int | None:
    """``--mem`` in MiB: a bare number is MiB (as llama.cpp's tools take it), else a size."""
    if text is None:
        return None
    size = int(text) * MiB if text.strip().isdigit() else parse_size(text)
    if size < MiB:
        raise TandemError(f"--mem {text} offers less than 1 MiB.")
    return size // MiB


def check_port(host: str, port: int) -> None:
    """Fail with one line before starting when the address cannot be bound."""
    if not 0 < port < 65536:
        raise TandemError(f"--port must be between 1 and 65535, not {port}.")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise TandemError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}.") from None


def server_command(binary: Path, args: argparse.Namespace) -> list[str]:
    threads = args.threads or cpu_cores()
    if threads < 1:
        raise TandemError("--threads must be at least 1.")
    cmd = [str(binary), "--host", args.host, "--port", str(args.port), "--threads", str(threads)]
    mem = mem_mib(args.mem)
    if mem is not None:
        cmd += ["--mem", str(mem)]
    return cmd + (["--cache"] if args.cache else [])


def run(args: argparse.Namespace) -> int:
    binary = find_binary()
    cmd = server_command(binary, args)
    if ":" in args.host:
        raise TandemError("llama.cpp's RPC server listens on IPv4 addresses or host names, not IPv6.")
    check_port(args.host, args.port)
    if not is_loopback(args.host):
        print(WARNING.format(host=args.host, port=args.port), file=sys.stderr, flush=True)
    offered = f", offering {format_size(mem_mib(args.mem) * MiB)}" if args.mem else ""
    print(f"tandem rpc-server: {args.host}:{args.port}{offered}; on the machine with the model: "
          f"tandem run -m MODEL --rpc {args.host}:{args.port}", file=sys.stderr, flush=True)
    import llama_cpp  # local: llama.cpp's libraries load only when this runs

    env = dict(os.environ)
    lib = str(Path(llama_cpp.__file__).parent / "lib")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    os.execve(cmd[0], cmd, env)  # the server replaces this process: signals reach it directly
    return 1  # not reached
