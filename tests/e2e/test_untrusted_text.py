#!/usr/bin/python3
"""End-to-end tests: text from the network never reaches a log line or bucketd-inspect's output
raw.

A sensor id may hold C1 controls (U+009B CSI, U+0085 NEL) and bidi overrides (U+202E): they are
valid UTF-8, so the parser takes them, and MongoDB stores them. The daemon's flusher error for
such a sensor's bucket (an update MongoDB refuses for good: the stored page has a string count)
and bucketd-inspect's verify, buckets --table and buckets --json output must show them escaped
(\\u009b, ...), never as the raw byte sequences a terminal acts on; JSON output stays valid JSON
whose values are what was sent.

Run: /usr/bin/python3 tests/e2e/test_untrusted_text.py   (environment: see bdtest.py, plus
BUCKETD_INSPECT_BIN, default <repo>/build/bucketd-inspect)
"""

import datetime
import json
import os
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

INSPECT = (os.environ.get("BUCKETD_INSPECT_BIN") or
           os.path.join(bdtest.REPO, "build", "bucketd-inspect"))
DEADLINE = 120.0
SPAN_S = 3600

# CSI "2J" (clear screen), CSI "31m" (red), NEL (a new line to some viewers), RLO (reverses
# what follows).
HOSTILE = "ev\u009b2J\u009b31m\u0085FORGED\u202eab"
ESCAPED = "ev\\u009b2J\\u009b31m\\u0085FORGED\\u202eab"
RAW = [c.encode() for c in ("\u009b", "\u0085", "\u202e")]


def inspect(*args, timeout=60):
    p = subprocess.run([INSPECT] + [str(a) for a in args], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


class UntrustedText(bdtest.E2ECase):

    def assertNoRaw(self, data, what):
        for raw in RAW:
            self.assertNotIn(raw, data, "%s holds the raw bytes %r:\n%s" % (
                what, raw, data.decode("utf-8", "replace")))

    def test_flusher_error_escapes_the_bucket_id(self):
        """A refused update of the hostile sensor's bucket is logged with its bucket id
        escaped, and no raw C1 or bidi sequence is anywhere in the daemon's log."""
        uri, client, db = self.new_database()
        now_s = int(time.time())
        start_s = now_s - now_s % SPAN_S
        bad_id = "%s|%d|0" % (HOSTILE, start_s)
        client[db]["buckets"].insert_one({
            "_id": bad_id, "sensor_id": HOSTILE, "page": 0, "count": "not a number",
            "bucket_start": datetime.datetime.fromtimestamp(start_s, datetime.timezone.utc)})
        d = self.daemon(uri, db).start()
        n = 5
        lines = ["%s v=%d %d" % (HOSTILE, i, (now_s * 1000 + i) * 1_000_000) for i in range(n)]
        with socket.create_connection(d.addr("tcp")) as sock:
            sock.sendall(("\n".join(lines) + "\n").encode())
        want = "bucket %s|%d|0" % (ESCAPED, start_s)
        ok = bdtest.wait_for(lambda: any(want in l and "rejected" in l
                                         for l in d.log_lines(max_priority=3)), DEADLINE)
        st = d.stop()
        self.assertTrue(ok, "no 'rejected ... %s' line:\n%s" % (want, d.log()))
        self.assertStat(st, "readings_quarantined", n, d)
        with open(d.log_path, "rb") as f:
            self.assertNoRaw(f.read(), "the daemon's log")

    def test_inspect_escapes_what_it_prints(self):
        """verify and buckets --table print the hostile id and field name escaped; buckets
        --json prints valid JSON with the values sent, without the raw sequences."""
        if not os.access(INSPECT, os.X_OK):
            self.fail("bucketd-inspect not found at %s (set BUCKETD_INSPECT_BIN)" % INSPECT)
        uri, client, db = self.new_database()
        now_s = int(time.time())
        start_s = now_s - now_s % SPAN_S
        field = "t\u009bemp\u202e"
        d = self.daemon(uri, db).start()
        n = 3
        lines = ["%s %s=%d %d" % (HOSTILE, field, i, (start_s + i) * 1_000_000_000)
                 for i in range(n)]
        with socket.create_connection(d.addr("tcp")) as sock:
            sock.sendall(("\n".join(lines) + "\n").encode())
        bdtest.wait_stored(client, db, n, DEADLINE)
        d.stop()
        # A broken copy of the page (under another page number), so that verify has a problem
        # to report about a document whose id holds the hostile text.
        page = client[db]["buckets"].find_one({"sensor_id": HOSTILE})
        self.assertIsNotNone(page)
        broken = dict(page, _id="%s|%d|7" % (HOSTILE, start_s), page=7, count="x")
        client[db]["buckets"].insert_one(broken)

        conn = ["--uri", uri, "--database", db]
        rc, out, err = inspect(*conn, "verify", "--sensor", HOSTILE, "--span", "1h")
        self.assertEqual(rc, 1, err.decode())
        self.assertIn(("%s|%d|7: " % (ESCAPED, start_s)).encode(), out, out.decode())
        self.assertNoRaw(out + err, "verify's output")

        rc, out, err = inspect(*conn, "buckets", "--sensor", HOSTILE, "--from", start_s,
                               "--to", start_s + SPAN_S, "--table")
        self.assertEqual(rc, 0, err.decode())
        self.assertIn(b"t\\u009bemp\\u202e.min", out, out.decode())
        self.assertNoRaw(out + err, "buckets --table")

        rc, out, err = inspect(*conn, "buckets", "--sensor", HOSTILE, "--from", start_s,
                               "--to", start_s + SPAN_S, "--json")
        self.assertEqual(rc, 0, err.decode())
        self.assertNoRaw(out + err, "buckets --json")
        docs = [json.loads(l) for l in out.decode().splitlines() if l.strip()]
        self.assertTrue(docs, out.decode())
        for doc in docs:
            self.assertEqual(doc["sensor_id"], HOSTILE)
        values = sorted(r[field] for doc in docs if doc["page"] == 0 for r in doc["readings"])
        self.assertEqual(values, list(range(n)))

    def test_bucketd_parse_json_escapes_them_and_keeps_the_values(self):
        """bucketd-parse's JSON (a contract: JSON objects, DESIGN.md section 5) writes the C1 and
        bidi characters as \\u escapes: the same strings once parsed, no raw sequence."""
        parse = os.path.join(os.path.dirname(INSPECT), "bucketd-parse")
        if not os.access(parse, os.X_OK):
            self.fail("bucketd-parse not found at %s" % parse)
        tag, field = "t\u0085\u2066", "f\u00e9\u202e"
        line = "%s,%s=\u6771 %s=1 1\n" % (HOSTILE, tag, field)
        p = subprocess.run([parse], input=line.encode(), capture_output=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        self.assertNoRaw(p.stdout, "bucketd-parse's output")
        self.assertIn(b"\\u009b", p.stdout)
        pt = json.loads(p.stdout.decode())
        self.assertEqual(pt["name"], HOSTILE)
        self.assertEqual(pt["tags"], [{"key": tag, "value": "\u6771"}])
        self.assertEqual(pt["fields"][0]["key"], field)
        self.assertIn("\u6771".encode(), p.stdout)  # ordinary text stays as it is


if __name__ == "__main__":
    unittest.main()
