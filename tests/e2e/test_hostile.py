#!/usr/bin/python3
"""Hostile input against the real daemon while a well-behaved sensor keeps sending.

Each test starts its own bucketd on a fresh database, starts the good sensor (bucketd-sim over
TCP, --seq, paced), throws one kind of hostile traffic at the listeners and then checks that
  - the daemon stayed up and exits 0 on SIGTERM,
  - every reading of the good sensor is stored exactly once (by its seq),
  - each bad input is counted under its reason in the final "stats:" line.

  test_random_bytes            thousands of seeded random UDP datagrams (up to 60 KB) and
                               random byte streams on several TCP connections
  test_oversized_lines         a 1 MiB line over TCP, lines of max_line + 1 bytes over TCP and
                               UDP, single-line datagrams of 60000 and 65507 bytes, and lines of
                               exactly max_line bytes (accepted)
  test_many_short_connections  up to 100,000 connect / one line / close cycles from a few
                               threads; every line stored, no descriptor leak
  test_slow_and_silent_clients a client dripping one byte every few ms, one that never sends
                               and one that stops half-way through a line (idle_timeout 3s)
  test_max_connections         more connections than max_connections: the surplus is refused
                               and counted, the ones already open keep working
  test_flooding_sensor_beside_quiet_ones
                               one sensor flat out on its own connection, held to its share of
                               the buffer pool (its connection pauses); ten other sensors send
                               QUIET_LINES lines on another connection meanwhile: all of them
                               are read and stored while the flood goes on, and in the end
                               every reading of both exactly once

No assertion depends on how fast anything runs: loops are bounded by counts and by generous
deadlines, and a deadline that cuts a loop short only lowers the numbers checked (never below
the minimum a test needs to mean something, which is reached however long it takes).

What each test expects comes from what it sent: the good sensor's summary and counts file, and
for random bytes the lines bucketd's own parser (bucketd-parse) accepts or rejects.

Run: /usr/bin/python3 tests/e2e/test_hostile.py   (see bdtest.py for the environment)
Environment (besides bdtest.py's): BUCKETD_SIM_BIN (default <repo>/build/bucketd-sim),
BUCKETD_PARSE_BIN (default <repo>/build/bucketd-parse), HOSTILE_SHORT_CONNECTIONS (default
100000) and HOSTILE_SHORT_SECONDS (default 25): the target and the deadline of
test_many_short_connections, which makes at least MIN_SHORT_CONNECTIONS (or the target, if
lower) whatever the deadline.
"""

import collections
import errno
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

SIM = os.environ.get("BUCKETD_SIM_BIN") or os.path.join(bdtest.REPO, "build", "bucketd-sim")
PARSE = os.environ.get("BUCKETD_PARSE_BIN") or os.path.join(bdtest.REPO, "build",
                                                            "bucketd-parse")

SPAN_S = 3600
MAX_READINGS = 3600
# limits.max_line for every test here: small enough that one UDP datagram (at most 65507
# bytes over IPv4) can carry a line that is too long, big enough that random bytes (a '\n'
# every 256 bytes on average) practically never make one.
MAX_LINE = 16384
# The good sensor: readings per second (paced), sensors, and where its sensor numbers start.
GOOD_RATE = 400
GOOD_SENSORS = 3
GOOD_OFFSET = 700000
# bucketd-sim's series keys: "m<k>[,rack=..],sensor=s<number>,site=...".
GOOD_ID_RE = re.compile(r"^m\d+,(?:rack=[^,]*,)?sensor=s(\d+),site=")

# Every counted line ("lines") ends in exactly one of these counters (src/ingest_core.c
# line_result and src/sensor.c bd_sensor_table_accept), so their sum equals "lines".
LINE_OUTCOMES = ("drop_line_too_long", "drop_parse_error", "drop_too_many_fields",
                 "drop_no_numeric", "drop_bad_name", "drop_field_limit", "drop_too_old",
                 "drop_too_new", "drop_buffer_full", "drop_sensor_limit", "readings_accepted")

# test_flooding_sensor_beside_quiet_ones: the quiet connection's lines (10 sensors, 3 fields),
# the flooding sensor's fields, and where each one's sensor numbers start (bucketd-sim
# --sensor-offset: disjoint from each other and from the good sensor).
QUIET_LINES = 20000
QUIET_SENSORS = 10
QUIET_OFFSET = 800000
FLOOD_FIELDS = 16
FLOOD_OFFSET = 900000

# Generous deadlines (seconds): they bound waits, they are never asserted as durations.
DEADLINE = 60.0
CLOSE_DEADLINE = 30.0
# test_many_short_connections makes at least this many connections, however slowly.
MIN_SHORT_CONNECTIONS = 2000

IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def log(msg):
    sys.stderr.write("    [hostile] %s\n" % msg)
    sys.stderr.flush()


def proc_net_entry(table, port, state=None):
    """The /proc/net/<table> row of the 127.0.0.1:port socket (optionally in state, e.g.
    "0A" for LISTEN) as its split fields, or None."""
    want = "0100007F:%04X" % port
    with open("/proc/net/%s" % table) as f:
        next(f)
        for line in f:
            p = line.split()
            if len(p) > 4 and p[1] == want and (state is None or p[3] == state):
                return p
    return None


def udp_queue(port):
    """(bytes waiting in the receive queue, datagrams the kernel dropped) of the daemon's UDP
    socket on 127.0.0.1:port."""
    p = proc_net_entry("udp", port)
    if p is None:
        raise AssertionError("no UDP socket on 127.0.0.1:%d in /proc/net/udp" % port)
    return int(p[4].split(":")[1], 16), int(p[-1])


def open_fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def wait_closed_by_peer(sock, timeout=CLOSE_DEADLINE):
    """Read until the peer closes: "eof", "reset", or None when timeout passed first. Data
    from bucketd is never expected (it sends nothing), so any is returned as "data"."""
    sock.settimeout(timeout)
    try:
        while True:
            b = sock.recv(65536)
            if not b:
                return "eof"
            return "data"
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    except socket.timeout:
        return None


def send_ignoring_reset(sock, data):
    """sendall that tolerates the peer closing on us; returns True if everything went."""
    try:
        sock.sendall(data)
        return True
    except (ConnectionResetError, BrokenPipeError):
        return False
    except OSError as e:
        if e.errno in (errno.ECONNRESET, errno.EPIPE):
            return False
        raise


def finish_connection(sock, timeout=CLOSE_DEADLINE):
    """Half-close our side and wait for bucketd to close its side, which it does only after
    it has consumed every byte we sent (src/tcp.c: conn_finish). Returns the outcome."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    how = wait_closed_by_peer(sock, timeout)
    sock.close()
    return how


def split_pieces(data):
    """The lines bucketd sees in a datagram or a whole TCP stream: split on '\\n'; the piece
    after the last '\\n' is a line too (end of datagram, or EOF on TCP)."""
    return data.split(b"\n")


def classify(pieces, max_line):
    """What can be said of random lines without running the parser.

    Returns a Counter:
      empty     zero-length pieces: not lines at all, never counted
      too_long  longer than max_line: each is exactly one drop_line_too_long
      sure_bad  not blank, not a comment ('#' after leading spaces) and not valid UTF-8: the
                parser rejects these as syntax errors before looking at anything else, so each
                is exactly one drop_parse_error
      maybe     everything else (blank, comment, or valid UTF-8): skipped (not counted), a
                parse error, or - by a tiny chance with random bytes - a valid line that then
                ends in any of LINE_OUTCOMES
    """
    c = collections.Counter()
    for p in pieces:
        if not p:
            c["empty"] += 1
            continue
        if len(p) > max_line:
            c["too_long"] += 1
            continue
        s = p[:-1] if p.endswith(b"\r") else p
        s = s.lstrip(b" ")
        if s and not s.startswith(b"#"):
            try:
                s.decode("utf-8")
            except UnicodeDecodeError:
                c["sure_bad"] += 1
                continue
        c["maybe"] += 1
    return c


def maybe_lines(pieces, max_line):
    """The pieces classify() counts as "maybe"."""
    return [p for p in pieces if classify([p], max_line)["maybe"]]


# Marker lines that keep each line on its own in one bucketd-parse run (as in
# test_lp_conformance.py): bucketd-parse reads one stream and continues a line that ends inside
# a quoted string value on the next line, which a listener never does (it splits at every
# newline, and such a line is a syntax error). MARK1 closes any open string and then fails, so
# a line joined to it still reports an error, as the listener does; MARK2, never joined, ends
# the line's output with an error that carries its line number.
MARK1 = b'"\x01'
MARK2 = b"\x01"


def parse_outcomes(lines):
    """What bucketd's parser makes of each of lines (no '\\n' inside): a Counter of "error",
    "point" and "skip" (blank or comment), and the points, from bucketd-parse."""
    data = bytearray()
    layout = []
    n = 1
    for line in lines:
        data += line + b"\n" + MARK1 + b"\n" + MARK2 + b"\n"
        layout.append((n, n + 1, n + 2))
        n += 3
    p = subprocess.run([PARSE, "--format", "influx", "--precision", "ns"], input=bytes(data),
                       capture_output=True, timeout=600)
    if p.returncode != 0:
        raise AssertionError("bucketd-parse exited %d: %s" % (p.returncode, p.stderr))
    objs = iter(json.loads(x) for x in p.stdout.splitlines())
    outcomes = collections.Counter()
    points = []
    for (first, mark1, mark2), line in zip(layout, lines):
        got = []
        for obj in objs:
            if "error" in obj and obj["line"] == mark2:
                break
            if "error" in obj and obj["line"] == mark1:
                continue
            got.append(obj)
        else:
            raise AssertionError("bucketd-parse output ended before line %d" % first)
        if len(got) > 1 or (got and "error" in got[0] and got[0]["line"] != first):
            raise AssertionError("line %r: unexpected bucketd-parse output %r" % (line, got))
        if not got:
            outcomes["skip"] += 1
        elif "error" in got[0]:
            outcomes["error"] += 1
        else:
            outcomes["point"] += 1
            points.append(got[0])
    return outcomes, points


def read_counts(path):
    counts = {}
    with open(path) as f:
        for line in f:
            sid, tab, n = line.rstrip("\n").partition("\t")
            assert tab, "bad counts line %r" % line
            counts[sid] = int(n)
    return counts


class Sim:
    """bucketd-sim over TCP with --seq and a counts file: to its --count, or until stop()."""

    def __init__(self, workdir, name, target, args):
        self.counts_path = os.path.join(workdir, name + "-counts")
        args = [SIM, "--target", "%s:%d" % target, "--proto", "tcp", "--seq", "--quiet",
                "--counts-file", self.counts_path] + list(args)
        self.proc = subprocess.Popen([str(a) for a in args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.summary = None
        self.counts = None

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()

    def finish(self, stop=False):
        """Wait for it (after SIGTERM if stop), then its summary and counts; fails unless it
        exited 0 without a send error and its counts add up to its summary."""
        if stop and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=3 * DEADLINE)
        lines = out.decode("utf-8", "replace").splitlines()
        err = err.decode("utf-8", "replace")
        if self.proc.returncode != 0 or len(lines) != 1:
            raise AssertionError("bucketd-sim exited %s\nstdout: %r\nstderr: %s" % (
                self.proc.returncode, lines, err))
        self.summary = json.loads(lines[0])
        if self.summary["send_errors"] != 0:
            raise AssertionError("bucketd-sim had send errors: %r\n%s" % (self.summary, err))
        self.counts = read_counts(self.counts_path)
        if sum(self.counts.values()) != self.summary["readings"]:
            raise AssertionError("counts file disagrees with the summary: %r %r" % (
                self.counts, self.summary))
        return self.summary


class GoodSensor(Sim):
    """bucketd-sim over TCP, paced, every reading with a unique seq, until stop()."""

    def __init__(self, workdir, target, seed):
        super().__init__(workdir, "good", target, [
            "--sensors", GOOD_SENSORS, "--sensor-offset", GOOD_OFFSET, "--fields", 2,
            "--rate", GOOD_RATE, "--seed", seed])

    def stop(self):
        """SIGTERM, then the summary (as finish)."""
        return self.finish(stop=True)


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------

class Hostile(bdtest.E2ECase):
    db_prefix = "hostile"

    @classmethod
    def setUpClass(cls):
        if not os.access(SIM, os.X_OK):
            raise AssertionError("%s not found or not executable (set BUCKETD_SIM_BIN)" % SIM)
        if not os.access(PARSE, os.X_OK):
            raise AssertionError("%s not found or not executable (set BUCKETD_PARSE_BIN)" % PARSE)

    # -- set-up -----------------------------------------------------------------------------
    def start(self, seed, tcp=None, extra=None):
        """A daemon (UDP + TCP influx listeners, max_line MAX_LINE; tcp: extra keys for the
        TCP listener) on a fresh database, and the good sensor sending to its TCP listener
        with at least one of its readings stored (so its connection is in and MongoDB is
        connected)."""
        self.uri, self.client, self.db = self.new_database()
        cfg = bdtest.deep_merge({"limits": {"max_line": "%dB" % MAX_LINE}},
                                extra)
        d = self.daemon(self.uri, self.db, max_readings=MAX_READINGS, extra=cfg)
        for lst in d.config["listeners"]:
            if lst["proto"] == "tcp":
                lst.update(tcp or {})
        d.start()
        self.d = d
        self.t0 = time.monotonic()
        self.good = GoodSensor(self.workdir, d.addr("tcp"), seed)
        self.addCleanup(self.good.kill)
        got = bdtest.wait_for(lambda: self.good_stored() > 0 or self.good.proc.poll() is not None,
                              DEADLINE, 0.1)
        if self.good.proc.poll() is not None:
            self.fail("bucketd-sim exited early: %r" % (self.good.proc.communicate(),))
        self.assertTrue(got, "no reading of the good sensor stored\n" + bdtest.log_tail(d.log()))
        return d

    # -- reading back -----------------------------------------------------------------------
    def counts_by_sensor(self):
        out = collections.Counter()
        for doc in self.client[self.db]["buckets"].find({}, {"sensor_id": 1, "count": 1}):
            out[doc.get("sensor_id")] += int(doc.get("count", 0))
        return out

    def good_stored(self):
        """Readings stored for the good sensor's series (known before its counts file)."""
        total = 0
        for sid, n in self.counts_by_sensor().items():
            m = GOOD_ID_RE.match(sid or "")
            if m and GOOD_OFFSET <= int(m.group(1)) < GOOD_OFFSET + GOOD_SENSORS:
                total += n
        return total

    def wait_counts(self, want, what):
        """Wait until the documents hold want[sensor_id] readings for every sensor in want."""
        last = [None]

        def done():
            got = self.counts_by_sensor()
            last[0] = {sid: got.get(sid, 0) for sid in want}
            return all(last[0][sid] >= n for sid, n in want.items())

        ok = bdtest.wait_for(done, DEADLINE, 0.2)
        self.assertTrue(ok, "%s: stored %r, want %r\n%s" % (what, last[0], want,
                                                           bdtest.log_tail(self.d.log())))

    def seqs(self, docs, sensor_ids=None, prefix=None):
        """Counter of (sensor_id, seq) of the stored readings of the sensors chosen."""
        out = collections.Counter()
        for doc in docs:
            sid = doc["sensor_id"]
            if sensor_ids is not None and sid not in sensor_ids:
                continue
            if prefix is not None and not sid.startswith(prefix):
                continue
            for r in doc["readings"]:
                out[(sid, r.get("seq"))] += 1
        return out

    # -- the end of every test ----------------------------------------------------------------
    def finish(self, want_other=None):
        """Stop the good sensor, wait for its readings (and want_other: {sensor_id: n}) to be
        stored, SIGTERM the daemon (exit 0 required) and check the good sensor's readings one
        by one. Returns (stats, documents)."""
        self.assertTrue(self.d.alive(), "bucketd died\n" + bdtest.log_tail(self.d.log()))
        summary = self.good.stop()
        want = dict(self.good.counts)
        want.update(want_other or {})
        self.wait_counts(want, "good sensor and expected readings")
        self.assertTrue(self.d.alive(), "bucketd died\n" + bdtest.log_tail(self.d.log()))
        stats = self.d.stop()  # fails unless bucketd exits 0
        self.assertIsNotNone(stats, "no stats line\n" + bdtest.log_tail(self.d.log()))
        self.assertNotRegex(self.d.log(), r"runtime error:|Sanitizer",
                            "sanitizer report in the log %s" % self.d.log_path)
        docs = self.documents(self.client, self.db)
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, MAX_READINGS),
                              "document invariants", self.d)

        good = self.seqs(docs, sensor_ids=set(self.good.counts))
        twice = [k for k, n in good.items() if n > 1]
        self.assertEqual(twice[:10], [], "good readings stored more than once")
        self.assertEqual(sorted(seq for _, seq in good), list(range(summary["readings"])),
                         "every seq of the good sensor exactly once")
        per_sensor = collections.Counter(sid for sid, _ in good)
        self.assertEqual(dict(per_sensor), self.good.counts, "good readings per sensor")

        # Every counted line ends in exactly one outcome.
        self.assertEqual(stats["lines"], sum(stats[k] for k in LINE_OUTCOMES),
                         "lines != sum of its outcomes: %r" % stats)
        self.assertStat(stats, "readings_flushed", stats["readings_accepted"], self.d)
        for name in ("drop_buffer_full", "drop_sensor_limit", "readings_lost",
                     "updates_quarantined", "udp_truncated", "udp_recv_errors",
                     "tcp_unread_at_stop", "udp_unread_at_stop"):
            self.assertStat(stats, name, 0, self.d)
        # Bad input is logged as rate-limited samples, never one line per input.
        warnings = self.d.log_lines(max_priority=4)
        self.assertLess(len(warnings), 80, "too many warning lines:\n" + "\n".join(warnings))
        log("stats: " + " ".join("%s=%d" % kv for kv in sorted(stats.items()) if kv[1]))
        log("good sensor: %d readings, %d bytes; %d warning lines; %.1fs" % (
            summary["readings"], summary["bytes"], len(warnings), time.monotonic() - self.t0))
        return stats, docs

    def assertBetween(self, stats, name, lo, hi):
        got = stats.get(name)
        self.assertTrue(got is not None and lo <= got <= hi,
                        "stats %s=%r, expected within [%d, %d]\nstats: %r" % (
                            name, got, lo, hi, stats))

    # -----------------------------------------------------------------------------------------
    # 1. Random bytes
    # -----------------------------------------------------------------------------------------
    def test_random_bytes(self):
        d = self.start(seed=11)
        udp, tcp = d.addr("udp"), d.addr("tcp")
        rnd = random.Random(20250115)
        # Half of the datagrams up to 60 KB, half short ones (up to 512 bytes).
        n_datagrams = 4000
        datagrams = [rnd.randbytes(rnd.randint(1, 60000) if rnd.random() < 0.5
                                   else rnd.randint(1, 512)) for _ in range(n_datagrams)]
        streams = [rnd.randbytes(rnd.randint(1 << 20, 3 << 20)) for _ in range(4)]

        # What the lines can be (see classify): exact for framing, bounds for parsing.
        udp_c = collections.Counter()
        maybe = []
        for dg in datagrams:
            udp_c.update(classify(split_pieces(dg), MAX_LINE))
            maybe += maybe_lines(split_pieces(dg), MAX_LINE)
        tcp_c = collections.Counter()
        for st in streams:
            c = classify(split_pieces(st), MAX_LINE)
            # A too-long line would make bucketd close the connection mid-stream; the data
            # must not contain one for the exact TCP byte count below.
            self.assertEqual(c["too_long"], 0, "random TCP stream with an over-long line")
            tcp_c.update(c)
            maybe += maybe_lines(split_pieces(st), MAX_LINE)
        total = udp_c + tcp_c
        # The "maybe" lines through bucketd's own parser: which it rejects, which are blank or
        # comments, and which (by chance) are points.
        parsed, points = parse_outcomes(maybe)
        self.assertEqual(sum(parsed.values()), total["maybe"])
        log("random: %d datagrams (%d bytes), %d TCP streams (%d bytes); lines: %r; the "
            "maybe lines parse as %r" % (n_datagrams, sum(map(len, datagrams)), len(streams),
                                         sum(map(len, streams)), dict(total), dict(parsed)))

        # UDP with flow control: the kernel silently drops datagrams that do not fit the
        # socket's receive buffer, and that would make every count a guess. Only our datagrams
        # go to this socket (the good sensor uses TCP), so keeping what waits in its queue
        # under half the buffer bucketd was granted means nothing is dropped (checked below
        # with the drops column of /proc/net/udp).
        m = re.search(r"receive buffer (\d+) bytes", d.log())
        budget = max(int(m.group(1)) if m else 0, 212992) // 2
        port = udp[1]
        udp_errors = []

        def udp_sender():
            try:
                u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                with u:
                    u.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
                    queued = 0
                    for dg in datagrams:
                        cost = len(dg) + 8192  # generous: skb overhead, page rounding
                        if queued + cost > budget:
                            deadline = time.monotonic() + DEADLINE
                            while True:
                                queued = udp_queue(port)[0]
                                if queued + cost <= budget or time.monotonic() > deadline:
                                    break
                                time.sleep(0.001)
                        u.sendto(dg, udp)
                        queued += cost
            except Exception as e:  # reported by the test
                udp_errors.append(e)

        tcp_results = [None] * len(streams)

        def tcp_sender(i):
            try:
                s = socket.create_connection(tcp, timeout=DEADLINE)
                data = memoryview(streams[i])
                r = random.Random(i)
                off = 0
                while off < len(data):
                    n = r.randint(1, 70000)
                    s.sendall(data[off:off + n])
                    off += n
                tcp_results[i] = finish_connection(s)
            except Exception as e:  # reported by the test
                tcp_results[i] = e

        threads = [threading.Thread(target=udp_sender, daemon=True)]
        threads += [threading.Thread(target=tcp_sender, args=(i,), daemon=True)
                    for i in range(len(streams))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3 * DEADLINE)
            self.assertFalse(t.is_alive(), "a random-bytes sender hung")
        self.assertEqual(udp_errors, [])
        self.assertEqual(tcp_results, ["eof"] * len(streams),
                         "each random TCP stream consumed, then closed by bucketd")
        # Everything sent has been read: bucketd's socket queue is empty again.
        self.assertTrue(bdtest.wait_for(lambda: udp_queue(port)[0] == 0, DEADLINE),
                        "bucketd stopped reading UDP")
        kernel_drops = udp_queue(port)[1]
        self.assertEqual(kernel_drops, 0, "the kernel dropped datagrams despite flow control")

        stats, docs = self.finish()
        good = self.good.summary

        # Exact: framing does not depend on what the bytes mean.
        self.assertStat(stats, "udp_datagrams", n_datagrams, d)
        self.assertStat(stats, "udp_bytes", sum(map(len, datagrams)), d)
        self.assertStat(stats, "tcp_connections", 1 + len(streams), d)
        self.assertStat(stats, "tcp_bytes", good["bytes"] + sum(map(len, streams)), d)
        self.assertStat(stats, "drop_line_too_long", total["too_long"], d)
        for name in ("tcp_rejected", "tcp_idle_closed"):
            self.assertStat(stats, name, 0, d)
        # Exact, from what was sent: every line not blank or a comment is counted; the parser
        # rejects the sure_bad lines and the "maybe" lines bucketd-parse rejects (the good
        # sensor sends no malformed lines, so every parse error is a random one).
        self.assertStat(stats, "drop_parse_error", total["sure_bad"] + parsed["error"], d)
        self.assertStat(stats, "lines", good["readings"] + total["too_long"] + total["sure_bad"]
                        + parsed["error"] + parsed["point"], d)
        # Random lines that parse (rare) are readings that may still be dropped (no numeric
        # field, a timestamp outside the window, ...); the documents hold the ones accepted.
        other = sum(len(doc["readings"]) for doc in docs
                    if doc["sensor_id"] not in self.good.counts)
        self.assertLessEqual(other, parsed["point"], "stored readings no random line holds")
        self.assertStat(stats, "readings_accepted", good["readings"] + other, d)

    # -----------------------------------------------------------------------------------------
    # 2. Over-long lines
    # -----------------------------------------------------------------------------------------
    def test_oversized_lines(self):
        d = self.start(seed=12)
        udp, tcp = d.addr("udp"), d.addr("tcp")

        def padded(head, length, tail=b",v=1i"):
            """A valid line of exactly length bytes: head, a string field pad (dropped and
            counted in string_fields_dropped), then tail."""
            base = head + b' pad=""' + tail
            line = head + b' pad="' + b"x" * (length - len(base)) + b'"' + tail
            assert len(line) == length
            return line

        # TCP A: a 1 MiB line (no newline for 1 MiB), then a valid line bucketd must never
        # reach: the connection is closed at the long line.
        big = b"huge,via=tcp v=" + b"9" * ((1 << 20) - 15)
        self.assertEqual(len(big), 1 << 20)
        a = socket.create_connection(tcp, timeout=DEADLINE)
        sent_all = send_ignoring_reset(a, big + b"\nafter_huge,via=tcp v=1i\n")
        self.assertIn(finish_connection(a), ("eof", "reset"))
        log("1 MiB line: client %s" % ("sent it all" if sent_all else "was cut off"))

        # TCP B: a complete line of max_line + 1 bytes, then a valid line (never reached).
        b = socket.create_connection(tcp, timeout=DEADLINE)
        line_b = padded(b"long,via=tcp", MAX_LINE + 1)
        send_ignoring_reset(b, line_b + b"\nafter_long,via=tcp v=1i\n")
        self.assertIn(finish_connection(b), ("eof", "reset"))

        # TCP C: a line of exactly max_line bytes is fine, and so is the line after it.
        c = socket.create_connection(tcp, timeout=DEADLINE)
        data_c = padded(b"edge,via=tcp", MAX_LINE) + b"\nafter_edge,via=tcp v=2i\n"
        c.sendall(data_c)
        self.assertEqual(finish_connection(c), "eof")

        # UDP: single-line datagrams of 60000 and 65507 bytes (the most IPv4 UDP carries),
        # a line of max_line + 1 followed by a valid one (UDP moves on to the next line), and
        # a line of exactly max_line bytes.
        port = udp[1]
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with u:
            udp_payloads = [
                b"dgram,via=udp v=" + b"7" * (60000 - 16),
                b"dgram,via=udp v=" + b"7" * (65507 - 16),
                padded(b"long,via=udp", MAX_LINE + 1) + b"\nafter_long,via=udp v=3i",
                padded(b"edge,via=udp", MAX_LINE),
            ]
            self.assertEqual([len(p) for p in udp_payloads[:2]], [60000, 65507])
            for p in udp_payloads:
                u.sendto(p, udp)
        self.assertTrue(bdtest.wait_for(lambda: udp_queue(port)[0] == 0, DEADLINE))
        self.assertEqual(udp_queue(port)[1], 0, "kernel dropped datagrams")

        stored_ok = {"after_edge,via=tcp": 1, "edge,via=tcp": 1, "after_long,via=udp": 1,
                     "edge,via=udp": 1}
        stats, docs = self.finish(want_other=stored_ok)
        good = self.good.summary

        # Too long: TCP A and B, UDP 60000, 65507 and max_line + 1.
        self.assertStat(stats, "drop_line_too_long", 5, d)
        self.assertStat(stats, "drop_parse_error", 0, d)
        self.assertStat(stats, "lines", good["readings"] + 5 + 4, d)
        self.assertStat(stats, "readings_accepted", good["readings"] + 4, d)
        self.assertStat(stats, "string_fields_dropped", 2, d)  # the two max_line pads
        self.assertStat(stats, "tcp_connections", 1 + 3, d)
        self.assertStat(stats, "tcp_rejected", 0, d)
        self.assertStat(stats, "tcp_idle_closed", 0, d)
        self.assertStat(stats, "udp_datagrams", len(udp_payloads), d)
        self.assertStat(stats, "udp_bytes", sum(map(len, udp_payloads)), d)
        # bucketd reads a connection in pieces and stops at the first one that shows the line
        # is too long, so for A and B it read more than max_line bytes but not all of them
        # necessarily: bounds, and exact for C.
        fixed = good["bytes"] + len(data_c)
        self.assertBetween(stats, "tcp_bytes", fixed + 2 * (MAX_LINE + 1),
                           fixed + len(big) + len(line_b) + 64)
        stored = {doc["sensor_id"]: [{k: v for k, v in r.items() if k != "ts"}
                                     for r in doc["readings"]]
                  for doc in docs if doc["sensor_id"] not in self.good.counts}
        self.assertEqual(stored, {"after_edge,via=tcp": [{"v": 2}], "edge,via=tcp": [{"v": 1}],
                                  "after_long,via=udp": [{"v": 3}], "edge,via=udp": [{"v": 1}]},
                         "only the lines within max_line (and not after a TCP long line)")
        samples = [x for x in d.log_lines(max_priority=4) if "limits.max_line" in x]
        self.assertTrue(samples, "no sample of an over-long line logged")
        self.assertTrue(any("connection closed" in x for x in samples), samples)

    # -----------------------------------------------------------------------------------------
    # 3. Many short connections
    # -----------------------------------------------------------------------------------------
    def test_many_short_connections(self):
        target = int(os.environ.get("HOSTILE_SHORT_CONNECTIONS", "100000"))
        seconds = float(os.environ.get("HOSTILE_SHORT_SECONDS", "25"))
        d = self.start(seed=13)
        tcp = d.addr("tcp")
        pid = d.proc.pid
        fds_before = open_fds(pid)

        # Each client: connect, one line, half-close, wait for bucketd's close (it closes only
        # after consuming the line), close. So at most n_threads connections are open in
        # bucketd at a time (no max_connections refusals), and a connection whose close we saw
        # has been fully processed. Each thread uses its own loopback source address, with
        # the port picked at connect time, so TIME_WAIT sockets do not run the ephemeral ports
        # dry (net.ipv4.tcp_tw_reuse lets loopback reuse them anyway).
        n_threads = 4
        lock = threading.Lock()
        state = {"next": 0, "made": 0}
        deadline = time.monotonic() + seconds
        at_least = min(target, MIN_SHORT_CONNECTIONS)
        made = [[] for _ in range(n_threads)]        # seqs whose connection was established
        connect_errors = collections.Counter()
        other_errors = []

        def worker(i):
            src = "127.0.0.%d" % (2 + i)
            try:
                probe = socket.socket()
                probe.bind((src, 0))
                probe.close()
            except OSError:
                src = "127.0.0.1"
            fails = 0
            while True:
                with lock:
                    if state["next"] >= target or (state["made"] >= at_least and
                                                   time.monotonic() > deadline):
                        return
                    seq = state["next"]
                    state["next"] += 1
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                    s.bind((src, 0))
                    s.settimeout(CLOSE_DEADLINE)
                    s.connect(tcp)
                except OSError as e:
                    s.close()
                    with lock:
                        connect_errors[errno.errorcode.get(e.errno, str(e))] += 1
                    fails += 1
                    if fails > 1000:
                        return
                    time.sleep(0.01)
                    continue
                made[i].append(seq)
                with lock:
                    state["made"] += 1
                try:
                    s.sendall(b"short,thread=%d seq=%di\n" % (i, seq))
                    how = finish_connection(s)
                    if how != "eof":
                        other_errors.append("seq %d: %r" % (seq, how))
                except OSError as e:
                    other_errors.append("seq %d: %r" % (seq, e))
                    s.close()
                if len(other_errors) > 20:
                    return

        t0 = time.monotonic()
        threads = [threading.Thread(target=worker, args=(i,), daemon=True)
                   for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            # A bound on a hang: the first at_least connections are made however long they take.
            t.join(seconds + 3 * CLOSE_DEADLINE + 600)
            self.assertFalse(t.is_alive(), "a short-connection client hung")
        elapsed = time.monotonic() - t0
        n_made = sum(map(len, made))
        log("short connections: %d made of %d (%.1fs, %.0f/s), connect errors %r" % (
            n_made, target, elapsed, n_made / max(elapsed, 1e-9), dict(connect_errors)))
        self.assertEqual(other_errors, [], "short connections not closed cleanly by bucketd")
        # Running out of local ports is the client's problem; anything else is not.
        self.assertEqual(set(connect_errors) - {"EADDRNOTAVAIL"}, set(),
                         "connect errors: %r" % connect_errors)
        self.assertGreaterEqual(n_made, at_least, "connections made (not cut by the deadline)")

        # No descriptor leak: back near where it started once the clients are gone (the
        # MongoDB pool may open or close a connection meanwhile, hence the slack).
        last = [None]

        def settled():
            last[0] = open_fds(pid)
            return last[0] <= fds_before + 3

        bdtest.wait_for(settled, DEADLINE, 0.2)
        log("bucketd open fds: %d before, %d after" % (fds_before, last[0]))
        if last[0] > fds_before + 3:
            fds = []
            for f in os.listdir("/proc/%d/fd" % pid):
                try:
                    fds.append(os.readlink("/proc/%d/fd/%s" % (pid, f)))
                except OSError:
                    pass
            self.fail("descriptor leak: %d fds before, %d after:\n%s" % (
                fds_before, last[0], "\n".join(sorted(fds))))

        want = {"short,thread=%d" % i: len(made[i]) for i in range(n_threads) if made[i]}
        stats, docs = self.finish(want_other=want)
        good = self.good.summary
        self.assertStat(stats, "tcp_connections", 1 + n_made, d)
        self.assertStat(stats, "tcp_rejected", 0, d)
        self.assertStat(stats, "tcp_idle_closed", 0, d)
        self.assertStat(stats, "lines", good["readings"] + n_made, d)
        self.assertStat(stats, "readings_accepted", good["readings"] + n_made, d)
        for name in LINE_OUTCOMES[:-1]:
            self.assertStat(stats, name, 0, d)
        seqs = self.seqs(docs, prefix="short,")
        self.assertEqual([k for k, n in seqs.items() if n > 1][:10], [], "stored twice")
        want_seqs = {("short,thread=%d" % i, seq) for i in range(n_threads) for seq in made[i]}
        self.assertEqual(len(seqs), len(want_seqs))
        self.assertEqual(set(seqs), want_seqs, "every short connection's line stored once")

    # -----------------------------------------------------------------------------------------
    # 4. Slow and silent clients
    # -----------------------------------------------------------------------------------------
    def test_slow_and_silent_clients(self):
        # 3 s: far above any gap the drip client or the good sensor leaves between two sends,
        # even on a loaded machine, and still a short wait for the two idle connections.
        d = self.start(seed=14, tcp={"idle_timeout": "3s"})
        tcp = d.addr("tcp")

        # Never sends a byte; sends half a line and then nothing. Both must be closed by the
        # idle timeout (the half line is dropped with the connection, never stored).
        silent = socket.create_connection(tcp, timeout=DEADLINE)
        half = socket.create_connection(tcp, timeout=DEADLINE)
        half_data = b"half,via=tcp seq="
        half.sendall(half_data)

        # One byte every 5 ms, keeping its connection alive, for about three seconds. The
        # only timing this test relies on: a gap of 5 ms is far inside the 3 s idle timeout.
        drip_lines = [b"drip,via=tcp seq=%di\n" % i for i in range(24)]
        drip_data = b"".join(drip_lines)
        drip_result = {}

        def dripper():
            try:
                s = socket.create_connection(tcp, timeout=DEADLINE)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for i in range(len(drip_data)):
                    s.sendall(drip_data[i:i + 1])
                    time.sleep(0.005)
                drip_result["close"] = finish_connection(s)
            except Exception as e:  # reported by the test
                drip_result["error"] = e

        before = self.good_stored()
        t = threading.Thread(target=dripper, daemon=True)
        t.start()
        closes = {"silent": wait_closed_by_peer(silent), "half": wait_closed_by_peer(half)}
        silent.close()
        half.close()
        t.join(3 * DEADLINE)
        self.assertFalse(t.is_alive(), "drip client hung")
        self.assertEqual(drip_result, {"close": "eof"}, "drip connection")
        self.assertEqual(closes, {"silent": "eof", "half": "eof"},
                         "idle connections closed by bucketd")
        # The good sensor kept flowing meanwhile (its own connection, never idle).
        self.assertTrue(bdtest.wait_for(lambda: self.good_stored() > before, DEADLINE, 0.2),
                        "good sensor stalled")

        stats, docs = self.finish(want_other={"drip,via=tcp": len(drip_lines)})
        good = self.good.summary
        self.assertStat(stats, "tcp_idle_closed", 2, d)
        self.assertStat(stats, "tcp_connections", 1 + 3, d)
        self.assertStat(stats, "tcp_rejected", 0, d)
        self.assertStat(stats, "tcp_bytes", good["bytes"] + len(drip_data) + len(half_data), d)
        self.assertStat(stats, "lines", good["readings"] + len(drip_lines), d)
        self.assertStat(stats, "readings_accepted", good["readings"] + len(drip_lines), d)
        for name in LINE_OUTCOMES[:-1]:
            self.assertStat(stats, name, 0, d)
        seqs = self.seqs(docs, prefix="drip,")
        self.assertEqual(seqs, collections.Counter(
            {("drip,via=tcp", i): 1 for i in range(len(drip_lines))}))
        self.assertFalse([doc for doc in docs if doc["sensor_id"].startswith("half")],
                         "the half line of an idle connection was stored")

    # -----------------------------------------------------------------------------------------
    # 5. One sensor flat out beside quiet ones
    # -----------------------------------------------------------------------------------------
    def test_flooding_sensor_beside_quiet_ones(self):
        # limits.memory 8 MiB: a pool of 4 MiB, of which one sensor may hold an eighth, which
        # the flooding sensor fills within a fraction of a second at any pace of this machine.
        d = self.start(seed=16, extra={"limits": {"memory": "8MiB"}})
        tcp = d.addr("tcp")
        flood = Sim(self.workdir, "flood", tcp,
                    ["--sensors", 1, "--sensor-offset", FLOOD_OFFSET, "--fields",
                     FLOOD_FIELDS, "--rate", 0, "--seed", 161])
        self.addCleanup(flood.kill)

        def flood_stored():
            for sid, n in self.counts_by_sensor().items():
                m = GOOD_ID_RE.match(sid or "")
                if m and int(m.group(1)) == FLOOD_OFFSET and n > 0:
                    return sid
            return None

        flood_id = bdtest.wait_for(lambda: flood_stored() or flood.proc.poll() is not None,
                                   DEADLINE, 0.1)
        self.assertIsNone(flood.proc.poll(), "the flooding sender exited early")
        self.assertTrue(flood_id, "no reading of the flooding sensor stored\n" +
                        bdtest.log_tail(d.log()))

        # The quiet sensors: QUIET_LINES lines flat out on a connection of their own, while
        # the flood goes on.
        quiet = Sim(self.workdir, "quiet", tcp,
                    ["--sensors", QUIET_SENSORS, "--sensor-offset", QUIET_OFFSET, "--fields", 3,
                     "--rate", 0, "--count", QUIET_LINES, "--seed", 162])
        self.addCleanup(quiet.kill)
        qs = quiet.finish()
        self.assertEqual(qs["readings"], QUIET_LINES)
        self.assertEqual(len(quiet.counts), QUIET_SENSORS)
        # Every quiet line is stored while the flooding sensor is still sending: it never
        # holds the others back until it stops.
        self.wait_counts(quiet.counts, "quiet sensors beside the flood")
        self.assertIsNone(flood.proc.poll(), "the flooding sender stopped before the quiet "
                          "sensors' lines were stored")

        fs = flood.finish(stop=True)
        want = dict(quiet.counts)
        want.update(flood.counts)
        stats, docs = self.finish(want_other=want)
        # The flood really was held to its share: its connection paused for its sensor.
        self.assertGreater(stats["tcp_sensor_pauses"], 0, "the flooding connection never "
                           "paused: the test did not exercise the share")
        quiet_seqs = self.seqs(docs, sensor_ids=set(quiet.counts))
        self.assertEqual(sorted(quiet_seqs.elements()),
                         sorted((sid, i) for sid, i in quiet_seqs),
                         "quiet readings stored more than once")
        self.assertEqual(sorted(seq for _, seq in quiet_seqs), list(range(QUIET_LINES)),
                         "every seq of the quiet sensors exactly once")
        self.assertEqual(dict(collections.Counter(sid for sid, _ in quiet_seqs)), quiet.counts)
        flood_seqs = self.seqs(docs, sensor_ids=set(flood.counts))
        self.assertEqual(sorted(flood_seqs.elements()), sorted(flood_seqs),
                         "flood readings stored more than once")
        self.assertEqual(sorted(seq for _, seq in flood_seqs), list(range(fs["readings"])),
                         "every seq of the flooding sensor exactly once")
        log("flood: %d readings; quiet: %d readings; tcp_sensor_pauses %d" % (
            fs["readings"], qs["readings"], stats["tcp_sensor_pauses"]))

    # -----------------------------------------------------------------------------------------
    # 6. More connections than max_connections
    # -----------------------------------------------------------------------------------------
    def test_max_connections(self):
        max_conns = 8
        d = self.start(seed=15, tcp={"max_connections": max_conns})
        tcp = d.addr("tcp")
        # The good sensor holds one connection (start() saw its readings stored).
        holders = []
        for i in range(max_conns - 1):
            s = socket.create_connection(tcp, timeout=DEADLINE)
            s.sendall(b"holder,n=%d seq=0i\n" % i)
            holders.append(s)
        self.wait_counts({"holder,n=%d" % i: 1 for i in range(len(holders))},
                         "first line of every holder")

        # The surplus: each is accepted by the kernel, then closed by bucketd at once.
        n_surplus = 12
        outcomes = collections.Counter()
        for i in range(n_surplus):
            s = socket.create_connection(tcp, timeout=DEADLINE)
            send_ignoring_reset(s, b"surplus,n=%d seq=0i\n" % i)
            outcomes[wait_closed_by_peer(s)] += 1
            s.close()
        self.assertEqual(set(outcomes) - {"eof", "reset"}, set(),
                         "surplus connections not closed by bucketd: %r" % outcomes)

        # The first ones keep working.
        for i, s in enumerate(holders):
            s.sendall(b"holder,n=%d seq=1i\n" % i)
        self.wait_counts({"holder,n=%d" % i: 2 for i in range(len(holders))},
                         "second line of every holder")

        # Closing two frees two places: new connections are served again.
        for s in holders[:2]:
            self.assertEqual(finish_connection(s), "eof")
        for i in range(2):
            s = socket.create_connection(tcp, timeout=DEADLINE)
            s.sendall(b"late,n=%d seq=0i\n" % i)
            self.assertEqual(finish_connection(s), "eof")
        for s in holders[2:]:
            s.sendall(b"holder,n=%d seq=2i\n" % holders.index(s))
            self.assertEqual(finish_connection(s), "eof")

        want = {"holder,n=%d" % i: 2 if i < 2 else 3 for i in range(len(holders))}
        want.update({"late,n=0": 1, "late,n=1": 1})
        stats, docs = self.finish(want_other=want)
        good = self.good.summary
        n_lines = sum(want.values())
        self.assertStat(stats, "tcp_rejected", n_surplus, d)
        self.assertStat(stats, "tcp_connections", 1 + len(holders) + 2, d)
        self.assertStat(stats, "tcp_idle_closed", 0, d)
        self.assertStat(stats, "lines", good["readings"] + n_lines, d)
        self.assertStat(stats, "readings_accepted", good["readings"] + n_lines, d)
        self.assertFalse([doc for doc in docs if doc["sensor_id"].startswith("surplus")],
                         "a refused connection's line was stored")
        other = {doc["sensor_id"]: sorted(r["seq"] for r in doc["readings"])
                 for doc in docs if doc["sensor_id"] not in self.good.counts}
        self.assertEqual(other, {sid: list(range(n)) for sid, n in want.items()})
        refusals = [x for x in d.log_lines(max_priority=4) if "max_connections" in x]
        self.assertTrue(refusals, "refusals not logged")
        self.assertLessEqual(len(refusals), n_surplus)


if __name__ == "__main__":
    unittest.main(verbosity=2)
