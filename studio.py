"""Look inside a trained model in the browser: python studio.py [--ckpt RUN_OR_CKPT] [--host 127.0.0.1] [--port 8000]

Starts a local web server and prints its address. The page talks to the model (tokens stream in as
they are sampled; click one to see what else it could have been), shows where each head attends, what
each layer would predict (the logit lens), explain.py's walk through a layer, what the model copied
word for word from its training text, and how the run learned. The same server answers
POST /v1/completions in OpenAI's format. Everything the page needs ships with the project: it works
offline. Loads the newest run (outputs/latest) unless --ckpt names a run folder, a .ckpt file or a
Hugging Face GPT-2 folder.
"""

from __future__ import annotations

if __name__ == "__main__":
    from shell.startup import start_up

    start_up()  # before the imports: Ctrl-C stops at once, no garbage collection until the model is loaded

import argparse
import ipaddress
import socket
import sys

from checkpoint import CheckpointError, given_or_newest, load_checkpoint
from shell.programs import Parser, exit_quietly, given_path, run_program, say_what_it_learned, whole_number
from shell.startup import started

LOOPBACK = ("localhost",)


class UsageError(ValueError):
    """Bad command-line input; the message says what to change."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description="Serve a page (and an OpenAI-style API) to look inside a tinygpt2 model.")
    p.add_argument(
        "--ckpt",
        type=given_path,
        default=None,
        help="a run folder, .ckpt file or Hugging Face folder (default: outputs/latest)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=whole_number, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or mps")
    return p.parse_args(argv)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a UsageError that says why not."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is not a port; give 1 to 65535, or 0 for any free one")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror:
        raise UsageError(f"--host {host} is not an address of this machine; give e.g. 127.0.0.1") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port} ({err.strerror}); choose another --port, or 0 for any free one"
        ) from None
    return sock


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from web.server import make_app

    sock = listen(args.host, args.port)
    loaded = load_checkpoint(given_or_newest(args.ckpt))
    if loaded.tokenizer is None:
        raise CheckpointError(f"{loaded.path} carries no tokenizer, so its tokens cannot be turned into text")
    try:
        loaded.model.to(torch.device(args.device))
    except (RuntimeError, AssertionError) as err:
        raise UsageError(f"--device {args.device}: {str(err).splitlines()[0]}; use --device cpu") from None
    say_what_it_learned(loaded.config)
    if not is_loopback(args.host):
        print(
            f"warning: listening on {args.host}: anyone who can reach this machine can use the model; "
            "--host 127.0.0.1 keeps it to this machine",
            file=sys.stderr,
        )
    announced = f"studio: {address(sock)}  ({loaded.path}; Ctrl-C stops it)"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # the address is said once it answers
                print(announced, flush=True)

    app = make_app(loaded)
    started()  # (shell.startup): the libraries' and the model's objects are frozen out of the collector's way
    Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        return run_program(lambda: run(args), UsageError, CheckpointError)
    except KeyboardInterrupt:  # before the server runs; once it does, Ctrl-C shuts it down and ends the process as
        print(file=sys.stderr)  # a Ctrl-C'd program ends (status 130 in a shell)
        return 130


if __name__ == "__main__":
    exit_quietly(main())
