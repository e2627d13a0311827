#!/usr/bin/env python3
"""A small QEMU guest agent client for guest/debian/check.sh.

    qga.py SOCK wait TIMEOUT         connect and guest-ping until it answers;
                                     prints the seconds it took
    qga.py SOCK exec 'SHELL CMD'     guest-exec /bin/sh -c CMD, wait for it, print
                                     its stdout (stderr to stderr), exit with its code
    qga.py SOCK call CMD [JSON]      run one agent command, print its "return" as JSON
    qga.py SOCK shutdown             guest-shutdown (powerdown; no reply on success)

Every connection starts with 0xFF + guest-sync-delimited and discards input up
to the 0xFF sentinel, so stale replies of earlier clients are skipped.
"""

import base64
import json
import random
import socket
import sys
import time


class Agent:
    def __init__(self, path, timeout=5.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""

    def close(self):
        self.sock.close()

    def _read_until(self, pred, deadline):
        while True:
            r = pred()
            if r is not None:
                return r
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the guest agent")
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("agent socket closed")
            self.buf += chunk

    def _line(self):
        i = self.buf.find(b"\n")
        if i < 0:
            return None
        line, self.buf = self.buf[:i], self.buf[i + 1:]
        return line

    def sync(self, timeout):
        """guest-sync-delimited; True when the agent answered within timeout."""
        ident = random.randint(1, 2**31)
        msg = json.dumps({"execute": "guest-sync-delimited", "arguments": {"id": ident}})
        self.sock.sendall(b"\xff" + msg.encode() + b"\n")
        deadline = time.monotonic() + timeout
        try:
            while True:
                # Discard up to the 0xFF sentinel, then read one JSON line.
                def sentinel():
                    i = self.buf.find(b"\xff")
                    if i < 0:
                        self.buf = b""
                        return None
                    self.buf = self.buf[i + 1:]
                    return True

                self._read_until(sentinel, deadline)
                line = self._read_until(self._line, deadline)
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue
                if reply.get("return") == ident:
                    return True
        except (TimeoutError, socket.timeout):
            return False

    def call(self, cmd, args=None, timeout=30.0, reply=True):
        msg = {"execute": cmd}
        if args is not None:
            msg["arguments"] = args
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        if not reply:
            return None
        deadline = time.monotonic() + timeout
        while True:
            line = self._read_until(self._line, deadline)
            line = line.strip(b"\xff").strip()
            if not line:
                continue
            r = json.loads(line)
            if "error" in r:
                raise RuntimeError(f"{cmd}: {r['error'].get('class')}: {r['error'].get('desc')}")
            if "return" in r:
                return r["return"]


def connect(path, sync_timeout=3.0):
    a = Agent(path)
    if not a.sync(sync_timeout):
        a.close()
        raise TimeoutError("guest-sync-delimited not answered")
    return a


def wait(path, timeout):
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        try:
            a = Agent(path, timeout=2.0)
            try:
                # A short sync per attempt: before qemu-ga runs, nothing answers.
                if a.sync(0.5):
                    a.call("guest-ping", timeout=5.0)
                    return time.monotonic() - t0
            finally:
                a.close()
        except (OSError, TimeoutError, RuntimeError, ValueError) as e:
            last = e
            time.sleep(0.2)
    raise TimeoutError(f"guest agent did not answer within {timeout} s (last: {last})")


def guest_exec(path, cmd, timeout=120.0):
    a = connect(path)
    try:
        r = a.call("guest-exec", {"path": "/bin/sh", "arg": ["-c", cmd], "capture-output": True})
        pid = r["pid"]
        deadline = time.monotonic() + timeout
        while True:
            s = a.call("guest-exec-status", {"pid": pid})
            if s.get("exited"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"guest-exec of {cmd!r} still running after {timeout} s")
            time.sleep(0.2)
    finally:
        a.close()
    out = base64.b64decode(s.get("out-data", "")).decode(errors="replace")
    err = base64.b64decode(s.get("err-data", "")).decode(errors="replace")
    return s.get("exitcode", -1), out, err


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    path, op = sys.argv[1], sys.argv[2]
    if op == "wait":
        print(f"{wait(path, float(sys.argv[3])):.1f}")
    elif op == "exec":
        code, out, err = guest_exec(path, sys.argv[3])
        sys.stdout.write(out)
        sys.stderr.write(err)
        sys.exit(code)
    elif op == "call":
        args = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
        a = connect(path)
        try:
            print(json.dumps(a.call(sys.argv[3], args, timeout=60.0)))
        finally:
            a.close()
    elif op == "shutdown":
        a = connect(path)
        try:
            a.call("guest-shutdown", {"mode": "powerdown"}, reply=False)
        finally:
            a.close()
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
