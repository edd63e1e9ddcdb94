"""A local S3 endpoint (moto's server) on 127.0.0.1 for trying the product against s3:// by hand.

    make s3        # then, in another terminal, the lines it prints

It runs in the foreground with a bucket ``runs``; Ctrl-C stops it, and everything in it (it is in memory)
goes with it. s3fs (through botocore) honours AWS_ENDPOINT_URL, so the printed environment is all a
client needs; TRAIN_STORAGE_OPTIONS='{"client_kwargs": {"endpoint_url": ...}}' does the same per run.
LOCAL_S3_PORT picks another port than 5555.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

PORT = int(os.environ.get("LOCAL_S3_PORT", "5555"))
BUCKET = "runs"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def usage(endpoint: str) -> str:
    """The lines a person pastes into another terminal to train against this endpoint."""
    env = f"AWS_ENDPOINT_URL={endpoint} AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing"
    return (
        f"local S3 at {endpoint} with bucket '{BUCKET}'. In another terminal:\n\n"
        f"  {env} TRAIN_SAVE_FOLDER=s3://{BUCKET} .venv/bin/python -m flows.train\n"
        f"  {env} .venv/bin/python -m checkpointing ls s3://{BUCKET}/<run_name>\n\n"
        f"or, without AWS_ENDPOINT_URL:\n\n"
        f'  TRAIN_STORAGE_OPTIONS=\'{{"client_kwargs": {{"endpoint_url": "{endpoint}"}}}}\' '
        f"AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing TRAIN_SAVE_FOLDER=s3://{BUCKET} "
        f".venv/bin/python -m flows.train\n\nCtrl-C stops it."
    )


def main() -> int:
    if not port_is_free(PORT):
        print(f"error: 127.0.0.1:{PORT} is in use (another `make s3`?); stop it or set LOCAL_S3_PORT", file=sys.stderr)
        return 1
    import s3fs
    from moto.server import ThreadedMotoServer

    os.environ.update(CREDENTIALS)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # keep the lines above readable: no per-request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=PORT, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{PORT}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).mkdir(BUCKET)
    print(usage(endpoint), flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})  # Ctrl-C, or a kill, ends the foreground process
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # delivered to sigwait, not a thread
    sys.exit(main())
