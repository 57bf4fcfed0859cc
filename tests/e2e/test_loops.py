#!/usr/bin/python3
"""End-to-end: ingest.loops 2, a UDP listener read by two SO_REUSEPORT sockets.

The kernel spreads datagrams over the sockets by source address and port, so the tests send
every series from many source ports: one series then reaches both receive loops, and every
reading must still be stored exactly once with true summaries (one producer per sensor queue).
Also a reload that removes and adds UDP listeners, and a stop, with two loops.

No assertion depends on timing: waits have generous deadlines and are asserted only as bounds.

Run: /usr/bin/python3 tests/e2e/test_loops.py   (see bdtest.py for the environment)
"""

import os
import signal
import socket
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402
from bdtest import send_readings as sr  # noqa: E402

SPAN_S = 3600
STORE_DEADLINE = 120.0
PORTS = 64  # source ports: the chance that all hash to one of two sockets is 2**-63


class ManyPorts:
    """UDP sender that spreads datagrams over PORTS sockets (source ports), round robin."""

    def __init__(self, addr, lines_per_datagram=5, pace=True):
        self.pace = pace
        self.addr = addr
        self.per = lines_per_datagram
        self.socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(PORTS)]
        self.pending = []
        self.datagrams = 0
        self.readings = 0

    def line(self, line):
        self.pending.append(line)
        self.readings += 1
        if len(self.pending) >= self.per:
            self.flush()

    def flush(self):
        if self.pending:
            s = self.socks[self.datagrams % PORTS]
            s.sendto(b"\n".join(self.pending) + b"\n", self.addr)
            self.datagrams += 1
            self.pending = []
            if self.pace and self.datagrams % 200 == 0:
                time.sleep(0.002)  # pace: the receive buffers are not what this test is about

    def close(self):
        self.flush()
        for s in self.socks:
            s.close()


class Loops(bdtest.E2ECase):
    db_prefix = "e2e_loops"

    def loops_daemon(self, uri, db, listeners=None):
        return self.daemon(uri, db, listeners=listeners or [
            {"name": "udp", "proto": "udp", "format": "influx", "precision": "ns"}],
            extra={"ingest": {"loops": 2}})

    def assertStored(self, client, db, n, daemon):
        stored = bdtest.wait_stored(client, db, n, STORE_DEADLINE)
        if stored != n:
            self.fail("the documents hold %d readings, %d were sent\n--- log tail ---\n%s" %
                      (stored, n, bdtest.log_tail(daemon.log(), 30)))

    def check_all(self, client, db, readings, d):
        docs = self.documents(client, db)
        self.assertEqual(sum(doc["count"] for doc in docs), len(readings))
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, 3600), "invariants", d)
        self.assertNoProblems(bdtest.check_readings(docs, readings, SPAN_S), "readings", d)

    def test_one_series_from_many_ports(self):
        """4 series, each sent from 64 source ports: both loops see every series, and each
        reading is stored once, in order-independent buckets with true summaries."""
        uri, client, db = self.new_database("e2e_loops_once")
        d = self.loops_daemon(uri, db)
        readings = sr.shuffle(sr.make_readings(sensors=4, per_sensor=1500, seed=31), seed=32)
        d.start()
        self.assertIn("2 receive loops (SO_REUSEPORT)", d.log())
        # The threads are named, so that top, perf and the bench can tell them apart.
        names = set()
        for task in os.listdir("/proc/%d/task" % d.proc.pid):
            with open("/proc/%d/task/%s/comm" % (d.proc.pid, task)) as f:
                names.add(f.read().strip())
        self.assertTrue({"bd-flusher", "bd-io", "bd-recv-2"} <= names, names)
        s = ManyPorts(d.addr("udp"))
        for r in readings:
            s.line(r.line)
        s.close()
        self.assertStored(client, db, len(readings), d)
        stats = d.stop()
        self.assertStat(stats, "udp_datagrams", s.datagrams, d)
        # The second loop read a share of them (so a series reached both loops: every source
        # port carries lines of every series).
        self.assertGreater(stats["udp_datagrams_other_loops"], 0)
        self.assertLess(stats["udp_datagrams_other_loops"], s.datagrams)
        self.assertStat(stats, "readings_accepted", len(readings), d)
        self.assertStat(stats, "readings_flushed", len(readings), d)
        for name, value in sorted(stats.items()):
            if name.startswith("drop_"):
                self.assertStat(stats, name, 0, d)
        self.check_all(client, db, readings, d)

    def test_reload_and_stop(self):
        """A reload that keeps one UDP listener, removes another and adds a third, then a stop
        straight after the last datagrams: nothing sent is lost or doubled."""
        uri, client, db = self.new_database("e2e_loops_reload")
        d = self.loops_daemon(uri, db, listeners=[
            {"name": "keep", "proto": "udp"}, {"name": "gone", "proto": "udp"}])
        readings = sr.make_readings(sensors=6, per_sensor=600, seed=41)
        first, second, third = readings[0::3], readings[1::3], readings[2::3]
        d.start()
        sent = 0
        for part, names in ((first, ("keep", "gone")),):
            senders = [ManyPorts(d.addr(n)) for n in names]
            for i, r in enumerate(part):
                senders[i % len(senders)].line(r.line)
            for s in senders:
                s.close()
                sent += s.datagrams
        self.assertStored(client, db, len(first), d)

        # Reload: "gone" is removed (its sockets read out, its loops joined), "new" added.
        new_port = bdtest.free_port("udp")
        d.config["listeners"] = [
            {"proto": "udp", "bind": "127.0.0.1:%d" % d.addr("keep")[1], "format": "influx",
             "precision": "ns"},
            {"proto": "udp", "bind": "127.0.0.1:%d" % new_port, "format": "influx",
             "precision": "ns"}]
        d.reload()
        self.assertTrue(d.alive())
        senders = [ManyPorts(d.addr("keep")), ManyPorts(("127.0.0.1", new_port))]
        for i, r in enumerate(second):
            senders[i % 2].line(r.line)
        for s in senders:
            s.close()
            sent += s.datagrams
        self.assertStored(client, db, len(first) + len(second), d)

        # The stop with the last datagrams still queued in every socket: the process is
        # stopped (SIGSTOP) while they are sent, and continues with SIGTERM pending, so the
        # receive loops and the ingest thread find them at the stop's read-out.
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            senders = [ManyPorts(d.addr("keep"), pace=False),
                       ManyPorts(("127.0.0.1", new_port), pace=False)]
            for i, r in enumerate(third):
                senders[i % 2].line(r.line)
            for s in senders:
                s.close()
                sent += s.datagrams
            d.proc.send_signal(signal.SIGTERM)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        # Only the one SIGTERM: a second one during the stop would find its handler closed.
        d.proc.wait(60)
        stats = d.stop()
        self.assertStat(stats, "udp_datagrams", sent, d)
        self.assertStat(stats, "udp_unread_at_stop", 0, d)
        self.assertStat(stats, "readings_accepted", len(readings), d)
        self.assertStat(stats, "readings_flushed", len(readings), d)
        self.assertGreater(stats["udp_datagrams_other_loops"], 0)
        self.check_all(client, db, readings, d)


if __name__ == "__main__":
    unittest.main()
