"""End-to-end: whether the daemon trusts the wall clock (src/clock.c; README "Clocks on
gateways"), with the real daemon under tests/e2e/clock_shim.c, an LD_PRELOAD library that plays
the kernel's synchronisation status (adjtimex) and a wrong wall clock from a control file:

- started 2 hours behind and unsynchronised, the daemon says so (gauges
  bucketd_clock_synchronized and bucketd_clock_trusted 0, /healthz "clock":"waiting" and still
  200, the log line); stepped to the true time and reported synchronised, as NTP does, it follows
  (the gauges 1, "synchronized", the step logged and counted); the kernel dropping the flag later
  without a step sets the gauge to 0 and keeps the trust;
- the wait bound: never synchronised, it trusts the clock after time.wait_for_sync ("timeout",
  logged once), and a reload of the key ends a wait already past the new bound;
- the floor: a clock the kernel calls synchronised but earlier than the last write writer.state
  says this writer acknowledged is not trusted until it passes that time;
- a clock right from the start changes nothing: trusted at once, one log line, and readings
  sent over UDP and TCP are stored exactly once in their buckets.

Environment: BUCKETD_CLOCK_SHIM (the shim, set by ctest; default build/tests/clock_shim.so).
Run: /usr/bin/python3 tests/e2e/test_clock.py   (see bdtest.py for the environment)
"""

import json
import os
import re
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402
from bdtest import send_readings as sr  # noqa: E402

HOUR_NS = 3600 * bdtest.NS_PER_S
DEADLINE = 30.0


def healthz(port):
    status, _, body = bdtest.http_get(port, "/healthz")
    return status, json.loads(body)


class ClockCase(bdtest.E2ECase):
    db_prefix = "bdclock"

    def setUp(self):
        super().setUp()
        self.control = os.path.join(self.workdir, "clock-control")

    def play(self, offset_ns, synced):
        """What the shim plays from now on (replaced atomically)."""
        tmp = self.control + ".tmp"
        with open(tmp, "w") as f:
            f.write("%d %d\n" % (offset_ns, 1 if synced else 0))
        os.replace(tmp, self.control)

    def start(self, wait_for_sync="10m", before_start=None, **kw):
        uri, client, db = self.new_database()
        self.metrics_port = bdtest.free_port()
        d = self.daemon(uri, db, env=bdtest.clock_shim_env(self.control),
                        extra={"metrics": {"bind": "127.0.0.1:%d" % self.metrics_port},
                               "time": {"wait_for_sync": wait_for_sync}}, **kw)
        if before_start is not None:
            before_start(d)
        d.start()
        return d, client, db

    def gauge(self, name):
        return bdtest.metric(self.metrics_port, name)

    def wait_gauge(self, d, name, want):
        if not bdtest.wait_for(lambda: self.gauge(name) == want, DEADLINE):
            d.fail("%s stayed %r, expected %r" % (name, self.gauge(name), want))

    def wait_log(self, d, pattern, count=1):
        rx = re.compile(pattern)
        if not bdtest.wait_for(lambda: len(rx.findall(d.log())) >= count, DEADLINE):
            d.fail("no %r in the log" % pattern)

    def clock_lines(self, d):
        return [l for l in d.log().splitlines() if "clock: " in l]

    def test_unsynchronised_behind_then_stepped(self):
        self.play(-2 * HOUR_NS, False)
        d, _, _ = self.start()
        self.assertEqual(self.gauge("bucketd_clock_synchronized"), 0)
        self.assertEqual(self.gauge("bucketd_clock_trusted"), 0)
        self.assertEqual(self.gauge("bucketd_clock_steps_total"), 0)
        status, h = healthz(self.metrics_port)
        self.assertEqual(status, 200, "an untrusted clock is not a failure by itself: %r" % h)
        self.assertEqual(h["clock"], "waiting")
        self.assertIs(h["clock_synchronized"], False)
        lines = self.clock_lines(d)
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("clock: not trusted yet: the kernel reports it unsynchronised", lines[0])
        self.assertTrue(lines[0].startswith("<4>"), lines[0])

        # NTP steps the clock to the true time and the kernel reports it synchronised.
        self.play(0, True)
        self.wait_gauge(d, "bucketd_clock_synchronized", 1)
        self.assertEqual(self.gauge("bucketd_clock_trusted"), 1)
        self.assertEqual(self.gauge("bucketd_clock_steps_total"), 1)
        status, h = healthz(self.metrics_port)
        self.assertEqual((status, h["clock"], h["clock_synchronized"]),
                         (200, "synchronized", True), h)
        self.wait_log(d, r"clock: the wall clock is synchronised \(")
        log = d.log()
        self.assertRegex(log, r"clock: the wall clock was stepped forwards by 720\d\.\d{3} s")

        # No NTP reply for hours: the kernel drops the flag; no step, so the trust stays.
        self.play(0, False)
        self.wait_gauge(d, "bucketd_clock_synchronized", 0)
        self.assertEqual(self.gauge("bucketd_clock_trusted"), 1)
        status, h = healthz(self.metrics_port)
        self.assertEqual((status, h["clock"], h["clock_synchronized"]),
                         (200, "synchronized", False), h)
        self.wait_log(d, r"clock: the kernel reports it unsynchronised .*; still trusted")
        self.play(0, True)
        self.wait_gauge(d, "bucketd_clock_synchronized", 1)
        self.wait_log(d, r"clock: the kernel reports the wall clock synchronised again")
        d.stop()

    def test_wait_bound_and_its_reload(self):
        self.play(-2 * HOUR_NS, False)
        d, _, _ = self.start(wait_for_sync="1s")
        self.wait_gauge(d, "bucketd_clock_trusted", 1)
        self.assertEqual(self.gauge("bucketd_clock_synchronized"), 0)
        status, h = healthz(self.metrics_port)
        self.assertEqual((status, h["clock"], h["clock_synchronized"]), (200, "timeout", False),
                         h)
        self.wait_log(d, r"clock: still not synchronised after time.wait_for_sync \(1s\)")
        d.stop()
        # Logged once, however long it stayed so.
        self.assertEqual(len(re.findall(r"trusted by timeout", d.log())), 1, d.log())

        # A 10-minute wait, cut to 1 s by a reload: the wait (already longer) ends at once.
        d, _, _ = self.start(wait_for_sync="10m")
        self.assertEqual(self.gauge("bucketd_clock_trusted"), 0)
        d.config["time"]["wait_for_sync"] = "1s"
        out = d.reload()
        self.assertIn("reload: time.wait_for_sync: 10m -> 1s", out)
        self.wait_gauge(d, "bucketd_clock_trusted", 1)
        status, h = healthz(self.metrics_port)
        self.assertEqual(h["clock"], "timeout", h)
        d.stop()

    def test_floor_of_writer_state(self):
        # The previous run acknowledged a write 1 hour ahead of the (played) true time.
        ack_ms = time.time_ns() // bdtest.NS_PER_MS + 3600 * 1000

        def write_state(d):
            spool = d.config["spool"]["dir"]
            os.makedirs(spool, exist_ok=True)
            with open(os.path.join(spool, "writer.state"), "w") as f:
                f.write("bucketd-writer 1\nwriter_id %s\nreserved 4097\nmax_bucket_start_ms 0\n"
                        "last_ack_ms %d\nclean 1\n" % (d.config["writer_id"], ack_ms))
        self.play(0, True)
        d, _, _ = self.start(before_start=write_state)
        self.assertEqual(self.gauge("bucketd_clock_synchronized"), 0)
        self.assertEqual(self.gauge("bucketd_clock_trusted"), 0)
        self.assertEqual(healthz(self.metrics_port)[1]["clock"], "waiting")
        self.assertIn("earlier than the last write this writer had acknowledged (writer.state)",
                      d.log())
        # NTP steps the clock 2 hours forwards: past the floor, trusted.
        self.play(2 * HOUR_NS, True)
        self.wait_gauge(d, "bucketd_clock_synchronized", 1)
        self.assertEqual(healthz(self.metrics_port)[1]["clock"], "synchronized")
        d.stop()

    def test_right_clock_from_the_start_changes_nothing(self):
        self.play(0, True)
        d, client, db = self.start()
        self.assertEqual(self.gauge("bucketd_clock_synchronized"), 1)
        self.assertEqual(self.gauge("bucketd_clock_trusted"), 1)
        status, h = healthz(self.metrics_port)
        self.assertEqual((status, h["clock"], h["clock_synchronized"]),
                         (200, "synchronized", True), h)
        readings = sr.make_readings(sensors=4, per_sensor=30, seed=26)
        sr.send(readings, udp=d.addr("udp"), tcp=d.addr("tcp"))
        bdtest.wait_stored(client, db, len(readings), 120.0)
        stats = d.stop()
        lines = self.clock_lines(d)
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("clock: the wall clock is synchronised", lines[0])
        self.assertNotIn("stepped", d.log())
        self.assertNoProblems(bdtest.check_readings(self.documents(client, db), readings, 3600),
                              "readings", d)
        self.assertStat(stats, "readings_accepted", len(readings), d)


if __name__ == "__main__":
    unittest.main()
