#!/usr/bin/python3
"""End-to-end: who may send (listeners[].allow) and what one TCP sender may cost.

  test_outside_allow_is_dropped     a datagram and a TCP connection from 127.0.0.2 (the client
                                    socket bound to it) with allow [127.0.0.1/32]: counted
                                    overall and per listener, logged with the address, nothing
                                    of them stored; the allowed sender's lines are stored; a
                                    SIGHUP that changes allow applies to the running listeners
  test_dual_stack_matches_mapped    a "[::]:port" listener: IPv4 senders arrive as
                                    ::ffff:a.b.c.d and match the IPv4 entries
  test_one_address_cannot_take_every_slot
                                    1,024 connections from 127.0.0.1, each trickling a partial
                                    line: only max_connections_per_ip (default 64) are kept,
                                    the rest refused and counted, while 127.0.0.2 connects and
                                    has every line stored
  test_trickled_line_is_closed_by_idle_timeout
                                    a connection sending one byte at a time and never ending a
                                    line is closed by idle_timeout and counted
  test_idle_partial_lines_do_not_cost_max_line
                                    1,024 connections (16 source addresses) holding a partial
                                    line each: the daemon's data segment grows by far less than
                                    1,024 x limits.max_line
  test_daemon_raises_its_open_files_limit
                                    started with a soft RLIMIT_NOFILE of 512, the daemon raises
                                    it to the hard limit (logged) and holds 600 connections

No assertion depends on how fast anything runs: waits poll /metrics or the database with
generous deadlines. Expected values come from what the test sent.

Run: /usr/bin/python3 tests/e2e/test_allow.py   (see bdtest.py for the environment)
"""

import errno
import os
import resource
import socket
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

DEADLINE = 60.0


def raise_nofile(n):
    """The test opens more sockets than a default soft limit of 1024 allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        want = n if hard == resource.RLIM_INFINITY else min(n, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        raise AssertionError("RLIMIT_NOFILE hard limit %d is below the %d this test needs" %
                             (soft, n))


def scrape(port):
    """{(name, labels text): value} of /metrics."""
    return bdtest.scrape(port)[1]


def listener_labels(d, name):
    host, port = d.addr(name)
    proto = [l["proto"] for l in d.listeners if l["name"] == name][0]
    return '{proto="%s",bind="%s:%d"}' % (proto, host, port)


def connect_from(source, addr, timeout=DEADLINE):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(addr)
    return s


def closed_by_peer(sock, timeout=DEADLINE):
    """"eof" or "reset" once the peer has closed, None if it is still open after timeout."""
    sock.settimeout(timeout)
    try:
        while True:
            b = sock.recv(65536)
            if not b:
                return "eof"
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    except socket.timeout:
        return None


def send_ignoring_reset(sock, data):
    try:
        sock.sendall(data)
        return True
    except OSError as e:
        if e.errno in (errno.ECONNRESET, errno.EPIPE):
            return False
        raise


def proc_status(pid, field):
    """A field of /proc/PID/status in bytes (VmData, VmRSS)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                value, unit = line.split()[1:3]
                assert unit == "kB", line
                return int(value) * 1024
    raise AssertionError("no %s in /proc/%d/status" % (field, pid))


class AllowTest(bdtest.E2ECase):
    db_prefix = "e2e_allow"

    def start(self, listeners=None, extra=None, allow=None, tcp=None, bind=None):
        uri, client, db = self.new_database()
        port = bdtest.free_port()
        cfg = {"metrics": {"bind": "127.0.0.1:%d" % port}}
        d = self.daemon(uri, db, listeners=listeners, extra=bdtest.deep_merge(cfg, extra))
        if bind is not None:
            d.config["listeners"][0]["bind"] = bind
        for lc in d.config["listeners"]:
            if allow is not None:
                lc["allow"] = list(allow)
            if tcp and lc["proto"] == "tcp":
                lc.update(tcp)
        d.metrics_port = port
        d.client = client
        d.db = db
        d.start()
        return d

    def metric(self, d, name, labels=""):
        return scrape(d.metrics_port).get((name, labels), 0)

    def wait_metric(self, d, name, want, labels="", what=None):
        ok = bdtest.wait_for(lambda: self.metric(d, name, labels) >= want, DEADLINE, 0.1)
        got = self.metric(d, name, labels)
        if not ok:
            d.fail("%s%s stayed at %s, expected %s (%s)" % (name, labels, got, want, what or ""))
        return got

    def sensors(self, d):
        return {doc["sensor_id"]: doc["count"] for doc in
                d.client[d.db]["buckets"].find({}, {"sensor_id": 1, "count": 1})}

    def wait_sensors(self, d, want, what):
        """Every sensor of want stored with (at least) its count."""
        def done():
            have = self.sensors(d)
            return all(have.get(k, 0) >= n for k, n in want.items())
        if not bdtest.wait_for(done, DEADLINE, 0.1):
            d.fail("%s: stored %r, expected %r" % (what, self.sensors(d), want))

    # -----------------------------------------------------------------------------------------
    def test_outside_allow_is_dropped(self):
        d = self.start(allow=["127.0.0.1/32"])
        udp, tcp = d.addr("udp"), d.addr("tcp")
        now = time.time_ns()

        # From outside: one datagram, one connection (closed before anything is read).
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(("127.0.0.2", 0))
        u.sendto(b"blocked,via=udp seq=0i %d\n" % now, udp)
        t = connect_from("127.0.0.2", tcp)
        send_ignoring_reset(t, b"blocked,via=tcp seq=0i %d\n" % now)
        self.assertIn(closed_by_peer(t), ("eof", "reset"), "connection from 127.0.0.2 kept")
        t.close()
        self.wait_metric(d, "bucketd_listener_drop_not_allowed_total", 1,
                         listener_labels(d, "udp"), "the datagram from 127.0.0.2")
        self.wait_metric(d, "bucketd_listener_drop_not_allowed_total", 1,
                         listener_labels(d, "tcp"), "the connection from 127.0.0.2")

        # From inside: stored, on both listeners.
        a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        a.bind(("127.0.0.1", 0))
        a.sendto(b"ok,via=udp seq=0i %d\nok,via=udp seq=1i %d\n" % (now, now + 1), udp)
        s = connect_from("127.0.0.1", tcp)
        s.sendall(b"ok,via=tcp seq=0i %d\nok,via=tcp seq=1i %d\n" % (now, now + 1))
        self.wait_sensors(d, {"ok,via=udp": 2, "ok,via=tcp": 2}, "the allowed sender")

        # A reload that allows 127.0.0.2 only: applied to the running listeners at once. The
        # open connection from 127.0.0.1 was admitted before and stays.
        for lc in d.config["listeners"]:
            lc["allow"] = ["127.0.0.2"]
        out = d.reload()
        self.assertIn("listeners[0].allow: [\"127.0.0.1/32\"] -> [\"127.0.0.2/32\"]", out)
        self.assertNotIn("needs a restart", out)
        u.sendto(b"later,via=udp seq=0i %d\n" % now, udp)
        a.sendto(b"refused,via=udp seq=0i %d\n" % now, udp)
        self.wait_sensors(d, {"later,via=udp": 1}, "127.0.0.2 after the reload")
        self.wait_metric(d, "bucketd_listener_drop_not_allowed_total", 2,
                         listener_labels(d, "udp"), "127.0.0.1's datagram after the reload")
        s.sendall(b"ok,via=tcp seq=2i %d\n" % (now + 2))
        self.wait_sensors(d, {"ok,via=tcp": 3}, "the connection admitted before the reload")
        s.close()
        u.close()
        a.close()

        stats = d.stop()
        self.assertEqual(stats["drop_not_allowed"], 3, stats)
        self.assertEqual(stats["lines"], 2 + 2 + 1 + 1, stats)
        self.assertEqual(stats["readings_accepted"], 2 + 2 + 1 + 1, stats)
        self.assertEqual(stats["udp_datagrams"], 4, stats)
        self.assertEqual(stats["tcp_connections"], 1, stats)
        stored = self.sensors(d)
        self.assertEqual(stored, {"ok,via=udp": 2, "ok,via=tcp": 3, "later,via=udp": 1})
        warned = [l for l in d.log_lines(max_priority=4) if "not in allow" in l]
        self.assertTrue(any("datagram from 127.0.0.2:" in l for l in warned), warned)
        self.assertTrue(any("connection from 127.0.0.2:" in l for l in warned), warned)

    # -----------------------------------------------------------------------------------------
    def test_dual_stack_matches_mapped(self):
        try:
            probe = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
            probe.bind(("::", 0))
            probe.close()
        except OSError as e:
            self.fail("this machine cannot bind an IPv6 socket: %s" % e)
        port = bdtest.free_port("udp")
        d = self.start(listeners=[{"name": "udp", "proto": "udp"}], allow=["127.0.0.1/32"],
                       bind="[::]:%d" % port)
        now = time.time_ns()
        a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        a.bind(("127.0.0.1", 0))
        b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        b.bind(("127.0.0.2", 0))
        b.sendto(b"mapped,who=b seq=0i %d\n" % now, ("127.0.0.1", port))
        a.sendto(b"mapped,who=a seq=0i %d\n" % now, ("127.0.0.1", port))
        self.wait_sensors(d, {"mapped,who=a": 1}, "an IPv4 sender on a dual-stack socket")
        labels = '{proto="udp",bind="[::]:%d"}' % port
        self.wait_metric(d, "bucketd_listener_drop_not_allowed_total", 1, labels, "127.0.0.2")
        a.close()
        b.close()
        stats = d.stop()
        self.assertEqual(stats["drop_not_allowed"], 1, stats)
        self.assertEqual(self.sensors(d), {"mapped,who=a": 1})
        self.assertTrue(any("from [::ffff:127.0.0.2]:" in l or "from ::ffff:127.0.0.2" in l
                            for l in d.log_lines(max_priority=4)), d.log())

    # -----------------------------------------------------------------------------------------
    def test_one_address_cannot_take_every_slot(self):
        n_slow = 1024
        raise_nofile(n_slow + 256)
        d = self.start(listeners=[{"name": "tcp", "proto": "tcp"}])
        tcp = d.addr("tcp")
        labels = listener_labels(d, "tcp")
        slow = []
        try:
            for i in range(n_slow):
                s = connect_from("127.0.0.1", tcp)
                send_ignoring_reset(s, b"slow,n=%d seq=" % i)
                slow.append(s)
            # Every connection was answered: kept, or refused at accept.
            self.wait_metric(d, "bucketd_tcp_rejected_per_ip_total", n_slow - 64, "",
                             "connections past max_connections_per_ip")
            self.assertEqual(self.metric(d, "bucketd_listener_tcp_rejected_per_ip_total",
                                         labels), n_slow - 64)
            self.assertEqual(self.metric(d, "bucketd_listener_connections", labels), 64)

            # Another sender has room, and every line it sends is stored while the slow ones
            # keep trickling.
            now = time.time_ns()
            good = connect_from("127.0.0.2", tcp)
            n_good = 200
            for k in range(n_good):
                good.sendall(b"good,from=b seq=%di %d\n" % (k, now + k))
                if k % 20 == 0:
                    for s in slow:
                        send_ignoring_reset(s, b"1")
            good.shutdown(socket.SHUT_WR)
            self.assertEqual(closed_by_peer(good), "eof")
            good.close()
            self.wait_sensors(d, {"good,from=b": n_good}, "the second sender")
            # Stopped while the slow ones are open: their partial lines are torn, not lines
            # (closed first, each would end its line at EOF).
            stats = d.stop()
        finally:
            for s in slow:
                s.close()
        self.assertEqual(stats["tcp_rejected_per_ip"], n_slow - 64, stats)
        self.assertEqual(stats["tcp_rejected"], 0, stats)
        self.assertEqual(stats["tcp_connections"], 64 + 1, stats)
        self.assertEqual(stats["readings_accepted"], n_good, stats)
        self.assertEqual(stats["lines"], n_good, stats)
        self.assertGreater(stats["tcp_unread_at_stop"], 0, stats)
        self.assertEqual(self.sensors(d), {"good,from=b": n_good})
        self.assertTrue(any("max_connections_per_ip (64)" in l and "127.0.0.1:" in l
                            for l in d.log_lines(max_priority=4)), d.log())

    # -----------------------------------------------------------------------------------------
    def test_trickled_line_is_closed_by_idle_timeout(self):
        d = self.start(listeners=[{"name": "tcp", "proto": "tcp"}], tcp={"idle_timeout": "2s"})
        tcp = d.addr("tcp")
        now = time.time_ns()
        s = connect_from("127.0.0.1", tcp)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"first,via=tcp seq=0i %d\n" % now)
        self.wait_sensors(d, {"first,via=tcp": 1}, "the complete first line")
        result = {}
        stop = threading.Event()

        # One byte every 50 ms of a line that never ends: each is far inside the timeout, so
        # only the rule "a complete line, not a byte, shows the sender is alive" closes it.
        def trickle():
            k = 0
            deadline = time.monotonic() + 3 * DEADLINE
            while not stop.is_set() and time.monotonic() < deadline:
                if not send_ignoring_reset(s, b"x"):
                    result["closed"] = "send failed"
                    return
                k += 1
                time.sleep(0.05)
            result["closed"] = None

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        ok = bdtest.wait_for(lambda: self.metric(d, "bucketd_tcp_idle_closed_total") >= 1,
                             3 * DEADLINE, 0.2)
        stop.set()
        t.join(DEADLINE)
        if not ok:
            d.fail("a connection trickling one line byte by byte was never closed")
        self.assertIn(closed_by_peer(s), ("eof", "reset"))
        s.close()
        stats = d.stop()
        self.assertEqual(stats["tcp_idle_closed"], 1, stats)
        self.assertEqual(stats["readings_accepted"], 1, stats)
        self.assertEqual(self.sensors(d), {"first,via=tcp": 1})

    # -----------------------------------------------------------------------------------------
    def test_idle_partial_lines_do_not_cost_max_line(self):
        n_conns, sources = 1024, 16
        max_line = 1 << 20
        raise_nofile(n_conns + 256)
        d = self.start(listeners=[{"name": "tcp", "proto": "tcp"}],
                       extra={"limits": {"max_line": "1MiB"}})
        tcp = d.addr("tcp")
        pid = d.proc.pid
        # A first connection and line, so that whatever a first connection sets up once is in
        # the baseline.
        now = time.time_ns()
        w = connect_from("127.0.0.%d" % (sources + 1), tcp)
        w.sendall(b"warm,via=tcp seq=0i %d\n" % now)
        self.wait_sensors(d, {"warm,via=tcp": 1}, "the first line")
        before = proc_status(pid, "VmData")
        rss_before = proc_status(pid, "VmRSS")
        conns = []
        partial = b"partial,via=tcp,sensor=s0000 value=1"  # no '\n': held in the buffer
        try:
            for i in range(n_conns - 1):
                s = connect_from("127.0.0.%d" % (1 + i % sources), tcp)
                s.sendall(partial)
                conns.append(s)
            labels = listener_labels(d, "tcp")
            self.wait_metric(d, "bucketd_listener_connections", n_conns, labels, "all open")
            self.wait_metric(d, "bucketd_tcp_bytes_total",
                             len(partial) * (n_conns - 1) + len(b"warm,via=tcp seq=0i %d\n" % now),
                             "", "every partial line read")
            after = proc_status(pid, "VmData")
            rss_after = proc_status(pid, "VmRSS")
        finally:
            for s in conns:
                s.close()
            w.close()
        growth = after - before
        # Preallocated, each connection took max_line + 4 KiB (1 GiB here). A generous bound
        # for buffers that follow what was sent: an eighth of that.
        bound = n_conns * max_line // 8
        sys.stderr.write("\n%d connections with a partial line, limits.max_line %d: VmData "
                         "+%.1f MiB, VmRSS +%.1f MiB\n" % (n_conns, max_line, growth / 2**20,
                                                           (rss_after - rss_before) / 2**20))
        self.assertLess(growth, bound, "VmData grew by %d bytes for %d connections" %
                        (growth, n_conns))
        stats = d.stop()
        self.assertEqual(stats["tcp_connections"], n_conns, stats)
        self.assertEqual(stats["tcp_rejected"] + stats.get("tcp_rejected_per_ip", 0), 0, stats)

    # -----------------------------------------------------------------------------------------
    def test_daemon_raises_its_open_files_limit(self):
        """Started with a soft RLIMIT_NOFILE below what max_connections needs, the daemon
        raises it to the hard limit, says so, and then holds more connections than the soft
        limit it was started with would have allowed."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        n_conns = 600
        low = 512
        if hard != resource.RLIM_INFINITY and hard < n_conns + 1024 + 256:
            self.fail("RLIMIT_NOFILE hard limit %d is too low for this test" % hard)
        raise_nofile(n_conns + 256)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        try:
            d = self.start(listeners=[{"name": "tcp", "proto": "tcp"}])
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, n_conns + 256), hard))
        self.assertTrue(any("open files limit raised from %d to" % low in l
                            for l in d.log_lines(max_priority=6)), d.log())
        self.assertFalse([l for l in d.log_lines() if "cannot be honoured" in l])
        tcp = d.addr("tcp")
        labels = listener_labels(d, "tcp")
        conns = []
        try:
            for i in range(n_conns):
                # Ten sources, 60 each: within the default max_connections_per_ip (64).
                conns.append(connect_from("127.0.0.%d" % (1 + i % 10), tcp))
            self.wait_metric(d, "bucketd_listener_connections", n_conns, labels,
                             "more connections than the soft limit it started with")
        finally:
            for s in conns:
                s.close()
        stats = d.stop()
        self.assertEqual(stats["tcp_connections"], n_conns, stats)


if __name__ == "__main__":
    unittest.main()
