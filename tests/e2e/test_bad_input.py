#!/usr/bin/python3
"""Bad input, bad configs and an unreachable MongoDB: bucketd stays up and says why.

Counts are checked only once bucketd has provably consumed every input: a TCP connection is
finished when bucketd closes it after our half-close (it does so only after reading everything),
and the datagrams of one UDP socket arrive in order, so a marker line sent last on that socket
shows, once it is stored (or logged), that bucketd read everything before it. No assertion
depends on how fast anything runs.

Run: /usr/bin/python3 tests/e2e/test_bad_input.py   (see bdtest.py for the environment)
"""

import os
import random
import re
import socket
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402
from bdtest import send_readings as sr  # noqa: E402

SPAN_S = 3600
MAX_LINE = 4096
# Bounds on waits (seconds), never asserted as durations.
DEADLINE = 120.0

# Lines the influx grammar rejects (each counted once in drop_parse_error).
MALFORMED = [
    b"no_fields_here",
    b"m,tag temp=1",
    b"m temp=",
    b"m temp=1 notatime",
    b"m =1",
    b"m temp=1i2",
    b",tag=a temp=1",
    b"m temp=1,,hum=2",
    b"m temp=tru",
    b"m temp=1 123 456",
    # Last: a framing that let quoted strings span lines could only swallow this one line.
    b'm temp="unterminated',
]
# Lines that are not UTF-8 (rejected as syntax errors, like the conformance corpus says).
NOT_UTF8 = [
    b"caf\xe9,room=r1 temp=1.5",
    b"m,room=\xff\xfe temp=1",
    b"m t\xc3\x28=1",
]


def finish_tcp(conn):
    """Half-close conn and wait until bucketd closes its side, which it does only once it has
    read every byte sent (or, after an over-long line, when it gives up on the connection)."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(DEADLINE)
    try:
        while conn.recv(65536):
            pass
    except ConnectionResetError:
        pass


def random_garbage(n, seed):
    """n random bytes that can only be one rejected line: no newline, no '=' (so no field),
    not starting with a comment mark or blank."""
    rnd = random.Random(seed)
    forbidden = set(b"\n\r=")
    out = bytearray()
    while len(out) < n:
        b = rnd.randrange(256)
        if b in forbidden or (not out and b in b"# \t"):
            continue
        out.append(b)
    return bytes(out)


class GoodSensor(threading.Thread):
    """Keeps sending valid readings (sensor 0 over UDP, sensor 1 over TCP) in the background."""

    def __init__(self, udp, tcp, readings, interval=0.003):
        super().__init__(daemon=True)
        self.udp, self.tcp = udp, tcp
        self.readings = readings
        self.interval = interval
        self.summary = None
        self.error = None

    def run(self):
        try:
            with sr.Sender(udp=self.udp, tcp=self.tcp, pace_every=0) as s:
                for r in self.readings:
                    s.send_reading(r)
                    s.flush()
                    time.sleep(self.interval)
                self.summary = s.summary()
        except Exception as e:  # reported by the test
            self.error = e


class BadInput(bdtest.E2ECase):
    db_prefix = "bad"

    def test_bad_lines_are_counted_and_good_readings_stored(self):
        uri, client, db = self.new_database("bad_lines")
        d = self.daemon(uri, db, extra={"limits": {"max_line": MAX_LINE}})
        d.start()
        udp, tcp = d.addr("udp"), d.addr("tcp")
        now = time.time_ns()
        good = sr.make_readings(sensors=2, per_sensor=300, seed=41, prefix="good",
                                start_ns=now - 600 * sr.NS_PER_S, span_ns=540 * sr.NS_PER_S)
        sender = GoodSensor(udp, tcp, sr.shuffle(good, seed=42))
        sender.start()
        time.sleep(0.2)

        expect = {"drop_parse_error": 0, "drop_line_too_long": 0, "string_fields_dropped": 0,
                  "drop_no_numeric": 0, "drop_too_many_fields": 0, "drop_too_old": 0,
                  "drop_too_new": 0, "drop_bad_name": 0}
        ts = now - 60 * sr.NS_PER_S
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

        def both(lines, counter, per_line=1):
            """Each line once over UDP (own datagram) and once over a TCP connection."""
            for line in lines:
                u.sendto(line + b"\n", udp)
            with socket.create_connection(tcp, timeout=DEADLINE) as c:
                c.sendall(b"".join(line + b"\n" for line in lines))
                finish_tcp(c)
            if counter:
                expect[counter] += 2 * len(lines) * per_line

        # Malformed and non-UTF-8 lines.
        both(MALFORMED, "drop_parse_error")
        both(NOT_UTF8, "drop_parse_error")
        # A datagram of random bytes (one line, rejected).
        u.sendto(random_garbage(700, seed=43), udp)
        expect["drop_parse_error"] += 1
        # Blank and comment lines: nothing to count.
        both([b"", b"# just a comment", b"\r"], None)
        # A line longer than limits.max_line: over UDP, and over TCP on its own connection
        # (bucketd may close a connection that sent an over-long line).
        long_line = b"m,pad=" + b"x" * (MAX_LINE + 200) + b" temp=1 %d" % ts
        u.sendto(long_line + b"\n", udp)
        with socket.create_connection(tcp, timeout=DEADLINE) as c:
            try:
                c.sendall(long_line + b"\n")
            except (ConnectionResetError, BrokenPipeError):
                pass  # bucketd closed the connection at the long line: what the test wants
            else:
                finish_tcp(c)
        expect["drop_line_too_long"] += 2
        # String-only line: two string fields dropped, then no field is left.
        both([b'strings,id=a note="hello",other="world" %d' % ts], "drop_no_numeric")
        expect["string_fields_dropped"] += 2 * 2
        # Mixed line: the string field goes, the reading stays (checked below).
        mixed_udp = b'mixed,via=udp temp=1.5,note="hello" %d' % ts
        mixed_tcp = b'mixed,via=tcp temp=2.5,note="hello" %d' % (ts + sr.NS_PER_MS)
        u.sendto(mixed_udp + b"\n", udp)
        with socket.create_connection(tcp, timeout=DEADLINE) as c:
            c.sendall(mixed_tcp + b"\n")
            finish_tcp(c)
        expect["string_fields_dropped"] += 2
        # More fields than limits.max_fields (default 32).
        many = b"many " + b",".join(b"f%d=%d" % (i, i) for i in range(40)) + b" %d" % ts
        both([many], "drop_too_many_fields")
        # Outside the time window: 48 h old (max_late 24h), 1 h ahead (max_future 10m).
        both([b"old temp=1 %d" % (now - 48 * 3600 * sr.NS_PER_S)], "drop_too_old")
        both([b"future temp=1 %d" % (now + 3600 * sr.NS_PER_S)], "drop_too_new")
        # Field keys MongoDB would read as operators or paths, or that clash with "ts": stored
        # under their escaped names (bucketd-schema(7) "Field and tag names"), not dropped. (The parser
        # already refuses what would still be a drop_bad_name: invalid UTF-8, NUL, empty.)
        both([b"keys $op=1 %d" % ts, b"keys a.b=2 %d" % ts, b"keys ts=3 %d" % ts], None)
        # Last on the UDP socket: a good reading. Once it is stored, bucketd has read every
        # datagram sent before it (one socket to one socket on loopback: in order).
        u.sendto(b"marker,via=udp v=1i %d\n" % ts, udp)
        u.close()

        sender.join(DEADLINE)
        self.assertFalse(sender.is_alive(), "good sensor sender hung")
        self.assertIsNone(sender.error, "good sensor sender failed: %r" % sender.error)
        n_good = len(good) + 2 + 1 + 6  # plus the two mixed readings, the marker, the keys
        stored = bdtest.wait_stored(client, db, n_good, DEADLINE)
        self.assertEqual(stored, n_good, "readings stored\n" + bdtest.log_tail(d.log()))
        self.assertTrue(d.alive(), "bucketd died on bad input\n" + bdtest.log_tail(d.log()))
        stats = d.stop()

        self.assertStat(stats, "readings_accepted", n_good, d)
        self.assertStat(stats, "readings_flushed", n_good, d)
        for name, value in sorted(expect.items()):
            self.assertStat(stats, name, value, d)
        self.assertStat(stats, "drop_buffer_full", 0, d)
        self.assertStat(stats, "drop_sensor_limit", 0, d)

        docs = self.documents(client, db)
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, 3600), "invariants", d)
        good_ids = {r.sensor_id for r in good}
        self.assertNoProblems(
            bdtest.check_readings([x for x in docs if x["sensor_id"] in good_ids], good, SPAN_S),
            "good readings", d)
        mixed = sorted((x for x in docs if x["sensor_id"].startswith("mixed,")),
                       key=lambda x: x["sensor_id"])
        self.assertEqual([x["sensor_id"] for x in mixed], ["mixed,via=tcp", "mixed,via=udp"])
        self.assertEqual([[{k: v for k, v in r.items() if k != "ts"} for r in x["readings"]]
                          for x in mixed], [[{"temp": 2.5}], [{"temp": 1.5}]])
        marker = [x for x in docs if x["sensor_id"] == "marker,via=udp"]
        self.assertEqual([x["count"] for x in marker], [1])
        keys = [x for x in docs if x["sensor_id"] == "keys"]
        self.assertEqual(sorted(sorted((k, v) for k, v in r.items() if k != "ts")
                                for x in keys for r in x["readings"]),
                         [[("%24op", 1.0)]] * 2 + [[("%74s", 3.0)]] * 2 + [[("a%2Eb", 2.0)]] * 2)
        self.assertEqual(sorted(k for x in keys for k in x["summary"]), ["%24op", "%74s", "a%2Eb"])
        others = sorted({x["sensor_id"] for x in docs} - good_ids - {m["sensor_id"] for m in mixed}
                        - {"marker,via=udp", "keys"})
        self.assertEqual(others, [], "documents for rejected lines")

        # Samples of bad lines may be logged, but never one line per bad input.
        warnings = d.log_lines(max_priority=4)
        self.assertLess(len(warnings), 40, "too many warning lines:\n" + "\n".join(warnings))

    # -- command line ---------------------------------------------------------------------
    def write(self, name, text):
        path = os.path.join(self.workdir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def good_config_text(self):
        d = bdtest.Daemon(os.path.join(self.workdir, "cfg"), "mongodb://127.0.0.1:1/", "x")
        return bdtest.to_yaml(d.config) + "\n"

    def assertConfigError(self, path, line, cols, key, args_order=0):
        """--check-config fails naming FILE:LINE:COL (COL 1-based, one of cols) and key."""
        args = ["--check-config", "-c", path] if args_order == 0 else ["-c", path,
                                                                       "--check-config"]
        rc, out = bdtest.run_bucketd(args)
        self.assertEqual(rc, 1, "bucketd %s: rc %r\n%s" % (" ".join(args), rc, out))
        wheres = ["%s:%d:%d:" % (path, line, col) for col in cols]
        self.assertTrue(any(w in out for w in wheres),
                        "error should name %s\n%s" % (" or ".join(wheres), out))
        self.assertIn(key, out, "error should name the key %r\n%s" % (key, out))
        return out

    def test_check_config_accepts_good_config(self):
        path = self.write("good.yaml", self.good_config_text())
        for args in (["--check-config", "-c", path], ["-c", path, "--check-config"]):
            rc, out = bdtest.run_bucketd(args)
            self.assertEqual(rc, 0, "bucketd %s: rc %r\n%s" % (" ".join(args), rc, out))

    def test_check_config_creates_no_file(self):
        """Without writer_id the daemon generates one into spool.dir, --check-config not."""
        d = bdtest.Daemon(os.path.join(self.workdir, "nofiles"), "mongodb://127.0.0.1:1/", "x")
        d.config.pop("writer_id")
        spool = d.config["spool"]["dir"]
        path = self.write("no-writer-id.yaml", bdtest.to_yaml(d.config) + "\n")
        rc, out = bdtest.run_bucketd(["--check-config", "-c", path])
        self.assertEqual(rc, 0, out)
        self.assertFalse(os.path.exists(spool), "--check-config created %s" % spool)

    def test_check_config_unknown_key(self):
        text = self.good_config_text().splitlines()
        # A typo'd top-level key at the end, and a typo'd nested key under "flush:".
        text.append("flsuh_interval: 1s")
        path = self.write("typo_top.yaml", "\n".join(text) + "\n")
        self.assertConfigError(path, len(text), [1], "flsuh_interval")
        self.assertConfigError(path, len(text), [1], "flsuh_interval", args_order=1)

        text = self.good_config_text().splitlines()
        i = text.index("flush:")
        text.insert(i + 1, "  intervall: 200ms")
        path = self.write("typo_nested.yaml", "\n".join(text) + "\n")
        self.assertConfigError(path, i + 2, [3], "intervall")

    def test_check_config_bad_value(self):
        text = self.good_config_text().splitlines()
        i = next(n for n, line in enumerate(text) if line.startswith("  interval: "))
        text[i] = "  interval: 5x"
        path = self.write("bad_value.yaml", "\n".join(text) + "\n")
        # The mark may be the key's (column 3) or the value's (column 13).
        out = self.assertConfigError(path, i + 1, [3, 13], "interval")
        self.assertIn("5x", out)

    def test_version_and_help(self):
        rc, out = bdtest.run_bucketd(["--version"])
        self.assertEqual(rc, 0, out)
        self.assertRegex(out, r"\d+\.\d+\.\d+")
        rc, out = bdtest.run_bucketd(["--help"])
        self.assertEqual(rc, 0, out)
        self.assertIn("-c", out)
        self.assertIn("--check-config", out)

    # -- MongoDB unreachable --------------------------------------------------------------
    def test_unreachable_mongodb(self):
        uri = "mongodb://127.0.0.1:%d/?serverSelectionTimeoutMS=500&connectTimeoutMS=500" % (
            bdtest.closed_port())
        d = self.daemon(uri, "unreachable", extra={"flush": {"stop_timeout": "3s"}})
        d.start()
        readings = sr.make_readings(sensors=4, per_sensor=100, seed=51)
        # Nothing gets stored, so the end of the input is marked by one bad line per listener,
        # sent last on the same socket: once bucketd has logged both (the first bad line of a
        # listener is always logged), it has read everything sent before them.
        marks = (b"end-of-input-udp", b"end-of-input-tcp")
        with sr.Sender(udp=d.addr("udp"), tcp=d.addr("tcp")) as s:
            for r in sr.shuffle(readings, seed=52):
                s.send_reading(r)
            s.flush()
            s.datagram(marks[0] + b"\n")
            s.tcp_raw(marks[1] + b"\n")
            s.flush()
            summary = s.summary()
        self.assertTrue(bdtest.wait_for(lambda: all(m.decode() in d.log() for m in marks),
                                        DEADLINE),
                        "bucketd did not read all the input\n" + bdtest.log_tail(d.log()))

        def mongo_errors():
            # Not the clock's warning either (a test machine's clock may be unsynchronised).
            return [x for x in d.log_lines(max_priority=4)
                    if "bad line" not in x and "clock: " not in x]

        errors = bdtest.wait_for(mongo_errors, DEADLINE)
        self.assertTrue(d.alive(), "bucketd died without MongoDB\n" + bdtest.log_tail(d.log()))
        self.assertTrue(errors, "no error logged about MongoDB\n" + bdtest.log_tail(d.log()))
        self.assertLess(len(errors), 30, "an error per packet?\n" + "\n".join(errors[:40]))
        self.assertLess(len(errors), summary["datagrams"])

        # stop_timeout bounds the stop: well above 3 s on a loaded machine is fine, what must
        # not happen is waiting for MongoDB as if there were no deadline (the config default
        # is 30 s).
        stats = d.stop(timeout=60)
        self.assertLessEqual(d.stop_seconds, 3.0 + 12.0,
                             "stop took %.1fs with flush.stop_timeout 3s" % d.stop_seconds)
        self.assertStat(stats, "drop_parse_error", len(marks), d)
        self.assertStat(stats, "readings_accepted", len(readings), d)
        self.assertStat(stats, "readings_flushed", 0, d)
        # Never reached, so nothing could be placed: everything went to the spool unplaced,
        # to be written when a later start reaches MongoDB; nothing is lost.
        self.assertStat(stats, "readings_lost", 0, d)
        self.assertStat(stats, "readings_spooled", len(readings), d)
        self.assertStat(stats, "readings_spooled_unplaced", len(readings), d)
        self.assertTrue(re.search(r"%d readings MongoDB did not take were written to the spool"
                                  % len(readings), d.log()), d.log())


if __name__ == "__main__":
    unittest.main(verbosity=2)
