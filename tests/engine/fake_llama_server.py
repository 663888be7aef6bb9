"""A small HTTP server speaking llama.cpp's /health and /completion, misbehaving on request, for the
server adapter's failure tests (`tests/engine/test_server.py`): a real process on a real port.

    python fake_llama_server.py --port N --mode ok|never-ready|exit-at-start|crash|malformed|short [--spawn]

``ok`` answers ``n_predict`` tokens counting up from the prompt's last id; ``--spawn`` also starts a
sleeping grandchild (the adapter must stop the whole group); ``--pidfile`` records both pids.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="ok")
    ap.add_argument("--spawn", action="store_true")
    ap.add_argument("--pidfile", default="")
    ap.add_argument("--threads", default="")
    ap.add_argument("--tag", default="", help="ignored: lets a test find its servers among the processes")
    args = ap.parse_args()
    if args.mode == "exit-at-start":
        print("error: unknown argument --bogus", file=sys.stderr)
        return 1
    pids = [os.getpid()]
    if args.spawn:
        pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)
    if args.pidfile:
        with open(args.pidfile, "w") as f:
            json.dump(pids, f)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(503 if args.mode == "never-ready" else 200, b'{"status": "ok"}')

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if args.mode == "crash":
                os._exit(3)
            if args.mode == "malformed":
                return self._send(200, b"{not json")
            n = int(req["n_predict"]) - (1 if args.mode == "short" else 0)
            last = req["prompt"][-1]
            self._send(200, json.dumps({"tokens": [last + i + 1 for i in range(n)], "content": "",
                                        "timings": {"draft_n_accepted": n // 2, "draft_n": n},
                                        "threads": args.threads}).encode())

    HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
