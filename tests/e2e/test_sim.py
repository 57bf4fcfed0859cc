#!/usr/bin/python3
"""bucketd-sim: what it says it sent is what arrives, and bucketd stores all of it.

Two parts:
  SimSends       the simulator against receivers written here (UDP and TCP on loopback): its
                 summary, datagram packing, counts file, sequence numbers, repeatability and
                 disturbance fractions, checked line by line with bucketd-parse as the decoder.
  SimIntoDaemon  the simulator driving the real daemon into the MongoDB test server over UDP
                 and TCP, influx and graphite: every reading stored once, per-sensor counts as
                 the counts files say, every document invariant.

Run: /usr/bin/python3 tests/e2e/test_sim.py
Environment (besides bdtest.py's): BUCKETD_SIM_BIN (default <repo>/build/bucketd-sim),
BUCKETD_PARSE_BIN (default <repo>/build/bucketd-parse).
"""

import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

SIM = os.environ.get("BUCKETD_SIM_BIN") or os.path.join(bdtest.REPO, "build", "bucketd-sim")
PARSE = os.environ.get("BUCKETD_PARSE_BIN") or os.path.join(bdtest.REPO, "build",
                                                            "bucketd-parse")
NS_PER_S = 1_000_000_000
# A fixed "now" for runs that must repeat: 2025-01-15 14:00:00 UTC.
TIME_BASE = 1_736_949_600 * NS_PER_S
SPAN_S = 3600

Reading = collections.namedtuple("Reading", "sensor_id seq time fields")
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


# ---------------------------------------------------------------------------------------------
# Running the simulator, receiving, decoding
# ---------------------------------------------------------------------------------------------

def require_binary(path, env):
    if not os.access(path, os.X_OK):
        raise AssertionError("%s not found or not executable (set %s)" % (path, env))


def run_sim(*args, timeout=60):
    """Run bucketd-sim to completion; returns (exit status, summary dict or None, stderr)."""
    p = subprocess.run([SIM] + [str(a) for a in args], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=timeout)
    out = p.stdout.decode("utf-8", "replace").splitlines()
    summary = json.loads(out[0]) if len(out) == 1 else None
    return p.returncode, summary, p.stderr.decode("utf-8", "replace")


def start_sim(*args):
    return subprocess.Popen([SIM] + [str(a) for a in args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish_sim(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    lines = out.decode("utf-8", "replace").splitlines()
    summary = json.loads(lines[0]) if len(lines) == 1 else None
    return proc.returncode, summary, err.decode("utf-8", "replace")


def read_counts(path):
    counts = {}
    with open(path) as f:
        for line in f:
            sid, tab, n = line.rstrip("\n").partition("\t")
            assert tab, "bad counts line %r" % line
            assert sid not in counts, "sensor %s twice in %s" % (sid, path)
            counts[sid] = int(n)
    return counts


class UdpReceiver:
    """Collects every datagram sent to its loopback port until finish()."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        # Big enough to hold a whole run's datagrams even if this thread does not get to read
        # them until the sender is done (a loaded machine): past net.core.rmem_max when allowed.
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.datagrams = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def target(self):
        return "127.0.0.1:%d" % self.sock.getsockname()[1]

    def _run(self):
        while True:
            try:
                self.datagrams.append(self.sock.recv(65536))
            except socket.timeout:
                if self._stop.is_set():
                    return

    def finish(self):
        """Call after the sender exited: drains what the kernel holds, then stops."""
        self._stop.set()
        self._thread.join(30)
        self.sock.close()
        return self.datagrams


class TcpReceiver:
    """Accepts connections and keeps each one's bytes until the peer closes it."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.streams = []
        self._readers = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def target(self):
        return "127.0.0.1:%d" % self.sock.getsockname()[1]

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            buf = bytearray()
            self.streams.append(buf)
            t = threading.Thread(target=self._read, args=(conn, buf), daemon=True)
            self._readers.append(t)
            t.start()

    @staticmethod
    def _read(conn, buf):
        conn.settimeout(30)
        with conn:
            while True:
                b = conn.recv(1 << 20)
                if not b:
                    return
                buf += b

    def finish(self):
        """Call after the sender exited: waits for every connection's end of stream."""
        self._stop.set()
        self._thread.join(30)
        for t in self._readers:
            t.join(30)
        self.sock.close()
        return [bytes(b) for b in self.streams]


def decode(data, fmt="influx", precision="ns"):
    """Decode a byte stream of lines with bucketd-parse.

    Returns (readings, bad_lines) in stream order: readings as Reading tuples (graphite: the
    value is the sequence number), bad_lines the lines bucketd rejects.
    """
    assert data.endswith(b"\n") or not data, "stream does not end with a whole line"
    lines = data.split(b"\n")[:-1]
    args = [PARSE, "--format", fmt]
    if fmt == "influx":
        args += ["--precision", precision]
    p = subprocess.run(args, input=data, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    results = [json.loads(x) for x in p.stdout.splitlines()]
    assert len(results) == len(lines), "bucketd-parse answered %d of %d lines" % (
        len(results), len(lines))
    readings, bad = [], []
    for line, r in zip(lines, results):
        if "error" in r:
            bad.append(line)
            continue
        fields = {f["key"]: next(iter(f["value"].values())) for f in r["fields"]}
        if fmt == "influx":
            sid = r["name"] + "".join(",%s=%s" % (t["key"], t["value"]) for t in r["tags"])
            seq = fields.get("seq")
        else:
            sid = r["name"]
            seq = int(fields["value"])
        readings.append(Reading(sid, seq, r["time"], fields))
    return readings, bad


def per_sensor(readings):
    return dict(collections.Counter(r.sensor_id for r in readings))


# ---------------------------------------------------------------------------------------------
# The simulator against plain receivers
# ---------------------------------------------------------------------------------------------

class SimSends(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        require_binary(SIM, "BUCKETD_SIM_BIN")
        require_binary(PARSE, "BUCKETD_PARSE_BIN")

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="bucketd-sim-")

    def tearDown(self):
        for name in os.listdir(self.tmp):
            os.unlink(os.path.join(self.tmp, name))
        os.rmdir(self.tmp)

    def sim_ok(self, *args):
        rc, summary, err = run_sim(*args)
        self.assertEqual(rc, 0, "bucketd-sim %s failed: %s" % (" ".join(map(str, args)), err))
        self.assertIsNotNone(summary, "no single JSON summary line")
        return summary

    def udp_run(self, *args):
        rx = UdpReceiver()
        try:
            summary = self.sim_ok("--target", rx.target, *args)
        finally:
            datagrams = rx.finish()
        return summary, datagrams

    def tcp_run(self, *args):
        rx = TcpReceiver()
        try:
            summary = self.sim_ok("--target", rx.target, "--proto", "tcp", *args)
        finally:
            streams = rx.finish()
        return summary, streams

    def check_stream(self, summary, data, fmt, precision, counts_path, n, seq_start=0):
        """The lines of one run: readings, malformed, counts file and sequence numbers."""
        readings, bad = decode(data, fmt, precision)
        self.assertEqual(summary["readings"], n)
        self.assertEqual(len(readings), n, "valid lines received")
        self.assertEqual(len(bad), summary["malformed"], "rejected lines received")
        self.assertEqual(read_counts(counts_path), per_sensor(readings))
        seqs = [r.seq for r in readings]
        self.assertEqual(sorted(seqs), list(range(seq_start, seq_start + n)),
                         "each seq exactly once")
        return readings, bad

    def test_udp_one_reading_per_datagram(self):
        counts = os.path.join(self.tmp, "counts")
        summary, dgs = self.udp_run("--sensors", 50, "--count", 5000, "--rate", 20000, "--seq",
                                    "--malformed", 0.02, "--seed", 3, "--counts-file", counts)
        self.assertEqual((summary["proto"], summary["format"], summary["per_datagram"]),
                         ("udp", "influx", 1))
        self.assertEqual(summary["sensors"], 50)
        self.assertEqual(summary["send_errors"], 0)
        self.assertEqual(summary["datagrams"], len(dgs))
        self.assertEqual(summary["bytes"], sum(map(len, dgs)))
        self.assertTrue(all(d.count(b"\n") == 1 and d.endswith(b"\n") for d in dgs))
        readings, bad = self.check_stream(summary, b"".join(dgs), "influx", "ns", counts, 5000)
        self.assertGreater(len(bad), 30, "--malformed 0.02 of 5000")
        self.assertEqual(summary["datagrams"], 5000 + len(bad))
        # Realistic lines, tags written unsorted for some sensors, the fields asked for.
        lengths = [len(d) for d in dgs]
        self.assertTrue(60 <= sum(lengths) / len(lengths) <= 120, sum(lengths) / len(lengths))
        heads = {d.split(b" ")[0] for d in dgs}
        self.assertTrue(any(h.find(b",site=") < h.find(b",sensor=") for h in heads))
        self.assertEqual(set(readings[0].fields), {"f0", "f1", "f2", "f3", "seq"})
        self.assertIsInstance(readings[0].fields["f0"], float)
        self.assertIsInstance(readings[0].fields["f1"], int)
        # Stamped now.
        now = time.time_ns()
        self.assertTrue(all(now - 60 * NS_PER_S < r.time <= now for r in readings))

    def test_udp_packed_datagrams(self):
        counts = os.path.join(self.tmp, "counts")
        summary, dgs = self.udp_run("--sensors", 30, "--fields", 6, "--count", 5000,
                                    "--rate", 20000, "--per-datagram", 10, "--max-datagram", 600,
                                    "--seq", "--seq-start", 100000, "--precision", "ms",
                                    "--malformed", 0.01, "--out-of-order", 0.05,
                                    "--counts-file", counts)
        self.assertEqual(summary["per_datagram"], 10)
        self.assertEqual(summary["datagrams"], len(dgs))
        self.assertEqual(summary["bytes"], sum(map(len, dgs)))
        self.assertTrue(all(len(d) <= 600 for d in dgs), max(map(len, dgs)))
        self.assertTrue(all(d.endswith(b"\n") and d.count(b"\n") <= 10 for d in dgs))
        self.assertGreater(summary["readings"] / len(dgs), 3, "lines are packed")
        readings, _ = self.check_stream(summary, b"".join(dgs), "influx", "ms", counts, 5000,
                                        seq_start=100000)
        self.assertEqual(len(readings[0].fields), 7)
        now_ms = time.time_ns() // 1_000_000
        self.assertTrue(all(r.time % 1_000_000 == 0 for r in readings), "ms precision")
        self.assertTrue(all(now_ms - 60_000 < r.time // 1_000_000 <= now_ms for r in readings))

    def test_udp_big_datagrams_graphite_flat_out(self):
        counts = os.path.join(self.tmp, "counts")
        summary, dgs = self.udp_run("--format", "graphite", "--sensors", 40, "--count", 5000,
                                    "--per-datagram", 1000, "--max-datagram", 65000, "--seq",
                                    "--malformed", 0.01, "--counts-file", counts)
        self.assertEqual(summary["format"], "graphite")
        self.assertEqual(summary["datagrams"], len(dgs))
        self.assertEqual(summary["bytes"], sum(map(len, dgs)))
        self.assertTrue(all(len(d) <= 65000 and d.count(b"\n") <= 1000 for d in dgs))
        self.assertGreater(max(d.count(b"\n") for d in dgs), 500)
        readings, _ = self.check_stream(summary, b"".join(dgs), "graphite", "s", counts, 5000)
        self.assertTrue(all(r.sensor_id.startswith("sim.s") and r.sensor_id.endswith(".value")
                            for r in readings))
        now = time.time_ns()
        self.assertTrue(all(now - 60 * NS_PER_S < r.time <= now for r in readings))

    def test_tcp_round_robin_connections(self):
        counts = os.path.join(self.tmp, "counts")
        summary, streams = self.tcp_run("--connections", 2, "--sensors", 25, "--count", 5000,
                                        "--rate", 20000, "--seq", "--precision", "us",
                                        "--malformed", 0.01, "--counts-file", counts)
        self.assertEqual(summary["proto"], "tcp")
        self.assertEqual(summary["datagrams"], 0)
        self.assertEqual(len(streams), 2)
        self.assertTrue(all(s for s in streams), "both connections carried data")
        self.assertEqual(summary["bytes"], sum(map(len, streams)))
        # Chunks hold whole lines, so each connection's stream decodes on its own.
        readings, bad = [], []
        for s in streams:
            r, b = decode(s, "influx", "us")
            readings += r
            bad += b
        self.assertEqual(len(readings), 5000)
        self.assertEqual(len(bad), summary["malformed"])
        self.assertEqual(read_counts(counts), per_sensor(readings))
        self.assertEqual(sorted(r.seq for r in readings), list(range(5000)))
        self.assertTrue(all(r.time % 1000 == 0 for r in readings), "us precision")

    def test_record_holds_exactly_what_was_sent(self):
        rec = os.path.join(self.tmp, "record")
        summary, dgs = self.udp_run("--count", 2000, "--rate", 20000, "--per-datagram", 4,
                                    "--malformed", 0.02, "--record", rec)
        with open(rec, "rb") as f:
            recorded = f.read()
        self.assertEqual(len(recorded), summary["bytes"])
        self.assertEqual(recorded, b"".join(dgs), "UDP: the datagrams, in order")
        rec_tcp = os.path.join(self.tmp, "record-tcp")
        summary, streams = self.tcp_run("--count", 2000, "--rate", 20000, "--record", rec_tcp)
        with open(rec_tcp, "rb") as f:
            self.assertEqual(f.read(), b"".join(streams), "TCP: the stream")

    def test_same_seed_same_bytes(self):
        args = ("--count", 3000, "--sensors", 17, "--seq", "--time-base", TIME_BASE,
                "--spread", 7200, "--late", 0.05, "--dup-ts", 0.05, "--out-of-order", 0.05,
                "--malformed", 0.02)
        first, a = self.tcp_run("--seed", 42, *args)
        second, b = self.tcp_run("--seed", 42, *args)
        other, c = self.tcp_run("--seed", 43, *args)
        self.assertEqual(a, b, "same options and seed: same bytes")
        self.assertEqual(first["bytes"], second["bytes"])
        self.assertNotEqual(a, c, "another seed: other lines")
        # UDP flat out packs deterministically too.
        _, d1 = self.udp_run("--seed", 42, "--per-datagram", 8, *args)
        _, d2 = self.udp_run("--seed", 42, "--per-datagram", 8, *args)
        self.assertEqual(d1, d2)
        self.assertEqual(b"".join(d1), a[0], "the same lines whatever the transport")
        # Paced, the grouping may differ but the lines may not.
        _, d3 = self.udp_run("--seed", 42, "--per-datagram", 8, "--rate", 30000, *args)
        self.assertEqual(b"".join(d3), a[0])

    def test_short_names(self):
        counts = os.path.join(self.tmp, "counts")
        summary, streams = self.tcp_run("--count", 600, "--sensors", 200, "--sensor-offset", 123,
                                        "--short-names", "--fields", 3, "--seq",
                                        "--counts-file", counts)
        readings, _ = self.check_stream(summary, b"".join(streams), "influx", "ns", counts, 600)
        want = {"m,site=s%06d" % g for g in range(123, 323)}
        got = set(per_sensor(readings))
        self.assertLessEqual(got, want, "every sensor is m,site=sNNNNNN within the offset")
        self.assertGreater(len(got), 100, "sensors are spread over the 200")

    def test_disturbance_fractions(self):
        n, late_by = 20000, 60
        summary, streams = self.tcp_run("--count", n, "--sensors", 20, "--seq",
                                        "--time-base", TIME_BASE, "--late", 0.1,
                                        "--late-by", late_by, "--dup-ts", 0.1,
                                        "--out-of-order", 0.1, "--seed", 9)
        readings, bad = decode(streams[0])
        self.assertEqual(len(readings), n)
        self.assertEqual(bad, [])
        for name in ("late", "dup_ts", "out_of_order"):
            self.assertAlmostEqual(summary[name] / n, 0.1, delta=0.015, msg=name)

        # In the order they were made (by seq), a duplicate repeats its sensor's previous time;
        # a late reading is older than "now"; the others are "now" plus 1 ns per reading.
        prev = {}
        dups = lates = 0
        for r in sorted(readings, key=lambda r: r.seq):
            if prev.get(r.sensor_id) == r.time:
                dups += 1
            elif r.time < TIME_BASE:
                lates += 1
                self.assertGreaterEqual(r.time, TIME_BASE - late_by * NS_PER_S)
            else:
                self.assertLess(r.time, TIME_BASE + n)
            prev[r.sensor_id] = r.time
        self.assertEqual(dups, summary["dup_ts"])
        self.assertEqual(lates, summary["late"])

        # Out of order: a reading goes out at most 63 places early; descents in the sequence
        # numbers show about one or two per reading moved.
        seqs = [r.seq for r in readings]
        self.assertLessEqual(max(s - i for i, s in enumerate(seqs)), 63)
        descents = sum(1 for a, b in zip(seqs, seqs[1:]) if a > b)
        self.assertTrue(0.5 * summary["out_of_order"] <= descents
                        <= 2.5 * summary["out_of_order"], (descents, summary["out_of_order"]))

        # Without disturbances the stream is in time order.
        _, streams = self.tcp_run("--count", 2000, "--seq", "--time-base", TIME_BASE)
        times = [r.time for r in decode(streams[0])[0]]
        self.assertEqual(times, sorted(times))

    def test_spread(self):
        summary, streams = self.tcp_run("--count", 5000, "--spread", 7200, "--precision", "s",
                                        "--time-base", TIME_BASE)
        readings, _ = decode(streams[0], "influx", "s")
        times = [r.time // NS_PER_S for r in readings]
        base_s = TIME_BASE // NS_PER_S
        self.assertTrue(all(base_s - 7200 <= t <= base_s for t in times))
        # Uniform: each of the two hours holds about half.
        older = sum(1 for t in times if t < base_s - 3600)
        self.assertAlmostEqual(older / len(times), 0.5, delta=0.05)

    def test_duration_stops_the_run(self):
        """--duration ends a run that --count would not, and --rate is never exceeded.

        Only bounds that hold however slow the machine is: the run lasts at least the duration
        (and no longer than the test waited for it), and the token bucket sends at most rate x
        elapsed plus its initial tokens (never a flood after a stall). How close the pace comes
        to the rate is a measurement, not a correctness property: bench/suite.py prints each
        simulator run's achieved rate beside the rate asked for."""
        rate, duration = 2000, 0.5
        rx = UdpReceiver()
        t0 = time.monotonic()
        rc, summary, err = run_sim("--target", rx.target, "--duration", duration, "--rate", rate)
        elapsed = time.monotonic() - t0
        dgs = rx.finish()
        self.assertEqual(rc, 0, err)
        self.assertGreaterEqual(summary["elapsed_s"], duration)
        self.assertLessEqual(summary["elapsed_s"], elapsed)
        self.assertEqual(summary["datagrams"], len(dgs))
        self.assertGreater(summary["readings"], 0)
        # The pacer starts with one step of tokens (rate / 1000, at least one) and never holds
        # more than two steps: at most rate x elapsed + 2 steps.
        step = max(1, rate // 1000)
        self.assertLessEqual(summary["readings"], rate * summary["elapsed_s"] + 2 * step,
                             summary)

    def test_refused_datagrams_are_reported(self):
        port = bdtest.free_port("udp")
        rc, summary, err = run_sim("--target", "127.0.0.1:%d" % port, "--count", 2000,
                                   "--rate", 20000)
        self.assertEqual(rc, 1, "nobody listening must not look like success")
        self.assertGreater(summary["refused"], 0)
        self.assertIn("refused", err)

    def test_ipv6_target(self):
        try:
            s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
            s.bind(("::1", 0))
        except OSError:
            self.skipTest("no IPv6 loopback")
        s.settimeout(5)
        with s:
            rc, summary, err = run_sim("--target", "[::1]:%d" % s.getsockname()[1],
                                       "--count", 10, "--per-datagram", 10)
            self.assertEqual(rc, 0, err)
            self.assertEqual(s.recv(65536).count(b"\n"), 10)

    def test_bad_options(self):
        cases = [
            (["--target", "127.0.0.1:9", "--bogus"], "unknown option"),
            (["--count", "10"], "--target"),
            (["--target", "localhost:9"], "--target"),
            (["--target", "127.0.0.1:9", "--proto", "sctp"], "--proto"),
            (["--target", "127.0.0.1:9", "--late", "1.5"], "--late"),
            (["--target", "127.0.0.1:9", "--rate", "-1"], "--rate"),
            (["--target", "127.0.0.1:9", "--count", "0"], "--count"),
            (["--target", "127.0.0.1:9", "--fields", "100"], "--fields"),
            (["--target", "127.0.0.1:9", "--precision", "min"], "--precision"),
            (["--target", "127.0.0.1:9", "--per-datagram", "8", "--max-datagram", "80"],
             "--max-datagram"),
            (["--target", "127.0.0.1:9", "--connections", "2"], "--connections"),
            (["--target", "127.0.0.1:9", "--count"], "needs a value"),
            (["--target", "127.0.0.1:9", "extra"], "unexpected argument"),
        ]
        for args, want in cases:
            p = subprocess.run([SIM] + args, capture_output=True, timeout=10)
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertIn(want, p.stderr.decode(), args)
            self.assertEqual(p.stdout, b"", args)
        p = subprocess.run([SIM, "--help"], capture_output=True, timeout=10)
        self.assertEqual(p.returncode, 0)
        self.assertIn(b"usage: bucketd-sim", p.stdout)


# ---------------------------------------------------------------------------------------------
# The simulator driving the daemon
# ---------------------------------------------------------------------------------------------

class SimIntoDaemon(bdtest.E2ECase):
    db_prefix = "e2e_sim"

    @classmethod
    def setUpClass(cls):
        require_binary(SIM, "BUCKETD_SIM_BIN")

    def test_udp_tcp_graphite_into_daemon(self):
        """Three simulators at once; every reading stored once, counts per sensor as sent."""
        uri, client, db = self.new_database()
        cap = 50
        d = self.daemon(uri, db, max_readings=cap, listeners=[
            {"name": "udp", "proto": "udp", "format": "influx", "precision": "ns"},
            {"name": "tcp", "proto": "tcp", "format": "influx", "precision": "us"},
            {"name": "graphite", "proto": "udp", "format": "graphite", "precision": "s"},
        ])
        d.start()
        addr = {name: "%s:%d" % d.addr(name) for name in ("udp", "tcp", "graphite")}
        common = ("--seq", "--spread", 7200, "--late", 0.05, "--malformed", 0.01)
        # About a second each, so several flushes happen while readings (late ones too) arrive.
        runs = {
            "udp": (0, 4000, ["--proto", "udp", "--per-datagram", 8, "--sensors", 20,
                              "--rate", 4000, "--dup-ts", 0.02, "--out-of-order", 0.05,
                              "--seed", 1]),
            "tcp": (1_000_000, 4000, ["--proto", "tcp", "--connections", 2, "--precision", "us",
                                      "--sensors", 20, "--sensor-offset", 1000, "--rate", 4000,
                                      "--seed", 2]),
            "graphite": (2_000_000, 1000, ["--proto", "udp", "--format", "graphite",
                                           "--per-datagram", 4, "--sensors", 10, "--rate", 1000,
                                           "--seed", 3]),
        }
        t0_ms = time.time_ns() // 1_000_000
        procs = {}
        for name, (seq_start, n, args) in runs.items():
            counts = os.path.join(self.workdir, "counts-%s" % name)
            procs[name] = (counts, start_sim("--target", addr[name], "--count", n,
                                             "--seq-start", seq_start,
                                             "--counts-file", counts, *common, *args))
        summaries, counts = {}, {}
        for name, (path, proc) in procs.items():
            rc, summary, err = finish_sim(proc)
            self.assertEqual(rc, 0, "%s simulator: %s" % (name, err))
            summaries[name] = summary
            for sid, n in read_counts(path).items():
                self.assertNotIn(sid, counts, "sensor ids of the runs overlap")
                counts[sid] = n
        t1_ms = time.time_ns() // 1_000_000
        total = sum(s["readings"] for s in summaries.values())
        malformed = sum(s["malformed"] for s in summaries.values())
        self.assertEqual(total, 9000)
        self.assertGreater(malformed, 0)
        self.assertEqual(sum(counts.values()), total)

        stored = bdtest.wait_stored(client, db, total, 120)
        self.assertTrue(d.alive(), "bucketd died while receiving")
        stats = d.stop()
        self.assertEqual(stored, total, "stored before SIGTERM")

        # What the daemon saw is what the simulators said they sent.
        self.assertStat(stats, "udp_datagrams",
                        summaries["udp"]["datagrams"] + summaries["graphite"]["datagrams"], d)
        self.assertStat(stats, "udp_bytes",
                        summaries["udp"]["bytes"] + summaries["graphite"]["bytes"], d)
        self.assertStat(stats, "tcp_bytes", summaries["tcp"]["bytes"], d)
        self.assertStat(stats, "tcp_connections", 2, d)
        self.assertStat(stats, "lines", total + malformed, d)
        self.assertStat(stats, "drop_parse_error", malformed, d)
        self.assertStat(stats, "readings_accepted", total, d)
        self.assertStat(stats, "readings_flushed", total, d)
        for name, value in sorted(stats.items()):
            if name.startswith("drop_") and name != "drop_parse_error":
                self.assertStat(stats, name, 0, d)
        self.assertStat(stats, "readings_lost", 0, d)

        docs = self.documents(client, db)
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, cap), "invariants", d)
        stored_counts = collections.Counter()
        seqs = collections.Counter()
        for doc in docs:
            stored_counts[doc["sensor_id"]] += len(doc["readings"])
            for r in doc["readings"]:
                seqs[r["seq"] if "seq" in r else int(r["value"])] += 1
                ts_ms = bdtest.dt_ms(r["ts"])
                # --spread 7200 plus --late-by 3600 at most, stamped while the runs went on.
                self.assertTrue(t0_ms - 10800 * 1000 - 1000 <= ts_ms <= t1_ms + 1000, r)
        self.assertEqual(dict(stored_counts), counts, "stored readings per sensor")
        self.assertEqual([s for s, k in seqs.items() if k > 1], [], "seq stored twice")
        want = set()
        for seq_start, n, _ in runs.values():
            want.update(range(seq_start, seq_start + n))
        self.assertEqual(set(seqs), want)
        # --spread 7200 crosses hour boundaries; 200 readings per sensor fill pages of 50.
        self.assertGreaterEqual(len({bdtest.dt_ms(doc["bucket_start"]) for doc in docs}), 3)
        self.assertGreaterEqual(max(doc["page"] for doc in docs), 1)
        # Sensor 1001 writes its tags unsorted (site, sensor, rack); its id has them sorted.
        sid = "m1,rack=r09,sensor=s1001,site=plant-1"
        self.assertIn(sid, counts)
        doc = next(doc for doc in docs if doc["sensor_id"] == sid)
        self.assertEqual(doc["meta"], {"measurement": "m1", "tags": {
            "rack": "r09", "sensor": "s1001", "site": "plant-1"}})


if __name__ == "__main__":
    unittest.main(verbosity=2)
