"""End-to-end: readings that arrive while the wall clock cannot be trusted are held and land in
their true hour (README "Clocks on gateways"; src/ingest_hold.c, include/bucketd/hold.h).

The real daemon runs under tests/e2e/clock_shim.c, which plays the kernel's synchronisation
status and a wall clock 2 hours behind, then steps it to the true time as NTP does. Readings
with and without a timestamp go over UDP and TCP before and after the step; each carries a
unique `seq`, and the test remembers the true time it sent each one. Expected values come from
that: a bare reading must be stored in the hour of its true send time with a timestamp within
2 s of it; a stamped one exactly as sent, none dropped as too new.

  test_bare_and_stamped_before_and_after_the_step   the scenario above
  test_mongodb_away_during_the_step                 the same with MongoDB away across the step
  test_the_wait_bound_stamps_with_the_clock_as_is   never synchronised: released after
                                                    time.wait_for_sync, counted
                                                    readings_stamped_unsynced
  test_held_lines_survive_a_graceful_restart        SIGTERM while held, a start (same boot),
                                                    then the step
  test_held_lines_survive_a_sigkill                 SIGKILL once the held-lines spool holds
                                                    them, a start, then the step
  test_a_right_clock_holds_nothing                  synchronised from the start: readings_held 0

Run: /usr/bin/python3 tests/e2e/test_clock_hold.py   (see bdtest.py for the environment)
"""

import os
import socket
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

NS = bdtest.NS_PER_S
HOUR_NS = 3600 * NS
BEHIND_NS = 2 * HOUR_NS
DEADLINE = 60.0


class HoldCase(bdtest.E2ECase):
    db_prefix = "bdhold"

    def setUp(self):
        super().setUp()
        self.control = os.path.join(self.workdir, "clock-control")
        self.sent = []  # (seq, true send time ns, stamped)
        self.line_lengths = []
        self.seq = 0

    def play(self, offset_ns, synced):
        tmp = self.control + ".tmp"
        with open(tmp, "w") as f:
            f.write("%d %d\n" % (offset_ns, 1 if synced else 0))
        os.replace(tmp, self.control)

    def new_daemon(self, uri, db, wait_for_sync="10m"):
        self.metrics_port = bdtest.free_port()
        return self.daemon(uri, db, env=bdtest.clock_shim_env(self.control),
                           listeners=[{"name": "udp", "proto": "udp", "format": "influx"},
                                      {"name": "tcp", "proto": "tcp", "format": "influx"}],
                           extra={"metrics": {"bind": "127.0.0.1:%d" % self.metrics_port},
                                  "time": {"wait_for_sync": wait_for_sync}})

    def send(self, d, n=20):
        """n readings over UDP and n over TCP, half of each with the true timestamp."""
        lines = {"udp": [], "tcp": []}
        for proto in ("udp", "tcp"):
            for k in range(n):
                self.seq += 1
                now = time.time_ns()
                stamped = k % 2 == 0
                line = "hold,proto=%s,s=%d v=%d.5,seq=%di" % (proto, k % 4, self.seq, self.seq)
                if stamped:
                    line += " %d" % now
                lines[proto].append(line.encode())
                self.sent.append((self.seq, now, stamped))
                self.line_lengths.append(len(line))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            for line in lines["udp"]:
                u.sendto(line + b"\n", d.addr("udp"))
        with socket.create_connection(d.addr("tcp"), timeout=10) as t:
            t.sendall(b"\n".join(lines["tcp"]) + b"\n")

    def stat(self, name):
        return bdtest.metric(self.metrics_port, "bucketd_%s_total" % name)

    def wait_stat(self, d, name, cond, what):
        ok = bdtest.wait_for(lambda: (self.stat(name) or 0) is not None and
                             cond(self.stat(name) or 0), DEADLINE)
        self.assertTrue(ok, "%s: %s=%r\n%s" % (what, name, self.stat(name),
                                                bdtest.log_tail(d.log(), 20)))

    def assertTrueHours(self, client, db, tolerance_ns=2 * NS):
        docs = self.documents(client, db)
        got = {}
        for doc in docs:
            start_ms = bdtest.dt_ms(doc["bucket_start"])
            for r in doc.get("readings") or []:
                seq = r.get("seq")
                self.assertNotIn(seq, got, "seq %d stored twice" % seq)
                got[seq] = (bdtest.dt_ms(r["ts"]), start_ms)
        for seq, sent_ns, stamped in self.sent:
            self.assertIn(seq, got, "seq %d never stored" % seq)
            ts_ms, start_ms = got[seq]
            want_ms = sent_ns // 1_000_000
            if stamped:
                self.assertEqual(ts_ms, want_ms, "seq %d: stamped reading changed" % seq)
            else:
                self.assertLessEqual(abs(ts_ms - want_ms) * 1_000_000, tolerance_ns,
                                     "seq %d: stamped %d ms, sent at %d ms" % (seq, ts_ms,
                                                                               want_ms))
            self.assertEqual(start_ms, ts_ms // 3_600_000 * 3_600_000,
                             "seq %d is not in the hour of its timestamp" % seq)
        self.assertEqual(len(got), len(self.sent))

    def held_then_stepped(self, d, client, db, n_before):
        self.wait_stat(d, "readings_held", lambda v: v >= n_before, "lines held")
        self.assertEqual(bdtest.stored_count(client, db, "buckets"), 0, "nothing stored before the step")
        self.play(0, True)  # NTP steps the clock to the true time

    def test_bare_and_stamped_before_and_after_the_step(self):
        self.play(-BEHIND_NS, False)
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db).start()
        self.send(d)
        self.held_then_stepped(d, client, db, 40)
        self.assertTrue(bdtest.wait_for(lambda: bdtest.metric(
            self.metrics_port, "bucketd_clock_trusted") == 1, DEADLINE))
        self.send(d)  # after the step: accepted at once
        self.assertEqual(bdtest.wait_stored(client, db, len(self.sent), DEADLINE),
                         len(self.sent), d.log())
        st = d.stop()
        self.assertTrueHours(client, db)
        for name, want in (("readings_held", 40), ("drop_too_new", 0), ("drop_too_old", 0),
                           ("readings_stamped_unsynced", 0), ("drop_clock_hold_full", 0),
                           ("readings_accepted", 80)):
            self.assertStat(st, name, want, d)

    def test_mongodb_away_during_the_step(self):
        self.play(-BEHIND_NS, False)
        uri, client, db = self.new_database()
        proxy, proxied = bdtest.start_fault_proxy(self, uri, client,
                                                  serverSelectionTimeoutMS=1000)
        d = self.new_daemon(proxied, db).start()
        self.send(d)
        self.wait_stat(d, "readings_held", lambda v: v >= 40, "lines held")
        proxy.set_fault("refuse")
        self.play(0, True)
        self.send(d)
        self.wait_stat(d, "readings_accepted", lambda v: v >= 80, "all accepted")
        proxy.set_fault("pass")
        self.assertEqual(bdtest.wait_stored(client, db, len(self.sent), DEADLINE),
                         len(self.sent), d.log())
        st = d.stop()
        self.assertTrueHours(client, db)
        self.assertStat(st, "drop_too_new", 0, d)

    def test_the_wait_bound_stamps_with_the_clock_as_is(self):
        self.play(-BEHIND_NS, False)
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db, wait_for_sync="3s").start()
        self.send(d, n=10)
        # Judged with the clock as it is, 2 hours behind: the stamped readings (true time) are
        # further ahead than buckets.max_future (1h) and dropped as too new; the bare ones are
        # stamped with the clock as it is, 2 hours early.
        bare = [s for s in self.sent if not s[2]]
        self.assertEqual(bdtest.wait_stored(client, db, len(bare), DEADLINE), len(bare),
                         d.log())
        st = d.stop()
        self.assertStat(st, "readings_held", 20, d)
        self.assertStat(st, "readings_stamped_unsynced", 20, d)
        self.assertStat(st, "drop_too_new", 10, d)
        warned = [l for l in d.log_lines(max_priority=4) if "readings_stamped_unsynced" in l]
        self.assertEqual(len(warned), 1, d.log())
        docs = self.documents(client, db)
        stored = {r["seq"]: bdtest.dt_ms(r["ts"]) for doc in docs for r in doc["readings"]}
        self.assertEqual(sorted(stored), sorted(s[0] for s in bare))
        for seq, sent_ns, _ in bare:
            self.assertLess(abs(stored[seq] * 1_000_000 - (sent_ns - BEHIND_NS)), 2 * NS,
                            "seq %d: stamped with the clock as it is" % seq)

    def restart_and_step(self, uri, db, d, client):
        d2 = self.daemon(uri, db, name="d2", env=bdtest.clock_shim_env(self.control),
                         listeners=[{"name": "udp", "proto": "udp", "format": "influx"}],
                         extra={"spool": {"dir": d.config["spool"]["dir"]},
                                "time": {"wait_for_sync": "10m"}})
        d2.start()
        self.assertTrue(any("from an earlier run" in l and "held" in l for l in d2.log_lines()),
                        d2.log())
        self.play(0, True)
        self.assertEqual(bdtest.wait_stored(client, db, len(self.sent), DEADLINE),
                         len(self.sent), d2.log())
        d2.stop()
        self.assertTrueHours(client, db)

    def test_held_lines_survive_a_graceful_restart(self):
        self.play(-BEHIND_NS, False)
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db).start()
        self.send(d)
        self.wait_stat(d, "readings_held", lambda v: v >= 40, "lines held")
        d.stop()
        self.assertTrue(any("are kept in" in l for l in d.log_lines(max_priority=4)), d.log())
        self.assertEqual(bdtest.stored_count(client, db, "buckets"), 0)
        self.restart_and_step(uri, db, d, client)

    def test_held_lines_survive_a_sigkill(self):
        """Held lines reach the held-lines spool at the next poll of the clock (twice a second):
        once the spool holds every line sent, a SIGKILL loses none of them."""
        self.play(-BEHIND_NS, False)
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db).start()
        self.send(d)
        held_dir = os.path.join(d.config["spool"]["dir"], "held")
        # Each line is kept as 16 bytes and its text, in records of 64-byte headers plus the
        # spool's 32 per record: wait until the files hold at least every line's bytes.
        lines_bytes = sum(16 + n for n in self.line_lengths)
        self.assertTrue(bdtest.wait_for(lambda: bdtest.spool_record_bytes(held_dir) >=
                                        lines_bytes, DEADLINE),
                        "the held lines never reached %s\n%s" % (held_dir, d.log()))
        d.kill()
        self.restart_and_step(uri, db, d, client)

    def test_a_right_clock_holds_nothing(self):
        self.play(0, True)
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db).start()
        self.send(d)
        self.assertEqual(bdtest.wait_stored(client, db, len(self.sent), DEADLINE),
                         len(self.sent), d.log())
        st = d.stop()
        self.assertStat(st, "readings_held", 0, d)
        self.assertStat(st, "readings_stamped_unsynced", 0, d)
        self.assertTrueHours(client, db, tolerance_ns=2 * NS)


if __name__ == "__main__":
    unittest.main()
