"""A local S3 endpoint (moto's server) on 127.0.0.1 for trying the product against s3:// by hand.

    make s3        # then, in another terminal, the lines it prints

Ctrl-C stops it; everything in it is in memory and goes with it.
"""

from __future__ import annotations

import os
import sys
import time

PORT = int(os.environ.get("LOCAL_S3_PORT", "5555"))
BUCKET = "runs"


def main() -> int:
    from moto.server import ThreadedMotoServer
    import s3fs

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=PORT, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{PORT}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir(BUCKET)
    print(f"local S3 at {endpoint} with bucket '{BUCKET}'. In another terminal:\n\n"
          f"  export AWS_ENDPOINT_URL={endpoint} AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing "
          f"AWS_DEFAULT_REGION=us-east-1\n"
          f"  .venv/bin/python -m flows.train --save_folder s3://{BUCKET} --run_name exp1\n"
          f"  .venv/bin/python -m checkpointing ls s3://{BUCKET}/exp1\n\nCtrl-C stops it.", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
