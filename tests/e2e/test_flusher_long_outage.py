#!/usr/bin/python3
"""Flusher regression 3 of test_flusher_regressions.py, on its own because it cannot be quick:
no stored page holds more than buckets.max_readings readings after an outage longer than a span,
when a bucket's late readings arrive after a newer bucket's. The outage must outlast two spans
plus max_late, and 1m is the smallest span the config allows, so the test takes 85 to 150 s. It
carries the label e2e_long (tests/CMakeLists.txt): tools/test.sh runs it on the plain build; the
page accounting it guards is unit-tested under the sanitizers (test_pages, test_flusher).

Run: /usr/bin/python3 tests/e2e/test_flusher_long_outage.py
Environment: as test_flusher_regressions.py.
"""

import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402
import test_flusher_regressions as regressions  # noqa: E402

NS = regressions.NS
MS = regressions.MS
reading = regressions.reading
send_tcp = regressions.send_tcp


class FlusherLongOutage(regressions.RegressionCase):
    def test_page_cap_across_a_long_outage(self):
        """span 1m, max_readings 5, max_late 3s (the late readings arrive within milliseconds
        of their timestamps). While MongoDB is unreachable: readings of bucket B0, then of the
        next bucket B1, then late readings of B0; MongoDB returns only when B0 ended more than
        span + max_late ago (so its page bookkeeping may be dropped while its readings still
        wait to be written).

        Takes 85 to 150 s, over the minute the other tests keep to: the outage must outlast
        two spans plus max_late counted from the start of B0, and 1m is the smallest span the
        config allows.

        On 18e0a24: when the readings were finally drained, B1 took over B0's bookkeeping
        slot, the late B0 readings started B0 again and were put on page 0 beside the readings
        already headed there, so one bulk carried two updates of page 0 under one flush
        sequence number; the second was refused by the first's number (11000) three times and
        then taken for another daemon using this writer_id: stored 10 of 13 readings,
        writer_conflicts=1, updates_quarantined=1, readings_quarantined=3 (the late ones)."""
        max_late = 3
        uri, client, db = self.new_database()
        proxy, proxied = self.proxy_for(uri, client)
        d = self.new_daemon(proxied, db, max_readings=5,
                            extra={"buckets": {"span": "1m", "max_late": "%ds" % max_late}}
                            ).start()
        # B0 is the current minute, with time left in it for the sends below.
        now = time.time_ns()
        if now % (60 * NS) > 40 * NS:
            time.sleep((60 * NS - now % (60 * NS)) / NS + 0.2)
        b0 = time.time_ns() // (60 * NS) * (60 * NS)
        sid, tags = "cap,sensor=c1", {"sensor": "c1"}
        seq = iter(range(1, 100))

        def r(ts_ns):
            s = next(seq)
            return reading(sid, "cap", tags, s, ts_ns, {"v": float(s), "seq": s})

        self.go_unreachable(proxy, d)
        mark = len(d.log())
        t = time.time_ns()
        first = [r(t)]                                        # B0: makes a write fail
        send_tcp(d.addr("tcp"), first)
        self.assertTrue(self.wait_log(d, "a failed attempt", lambda l: "retrying" in l, mark),
                        "no failed write while MongoDB was unreachable\n" + d.log()[mark:])
        t = time.time_ns()
        more_b0 = [r(t + k * MS) for k in range(1, 7)]        # B0: 7 in all, pages 0 and 1
        b1 = [r(b0 + 60 * NS + k * MS) for k in range(3)]      # B1 (ahead: max_future 10m)
        late_b0 = [r(t + k * MS) for k in range(10, 13)]       # B0 again, after B1
        self.assertTrue(all(x.ts_ns // (60 * NS) * (60 * NS) == b0
                            for x in first + more_b0 + late_b0))
        send_tcp(d.addr("tcp"), more_b0 + b1 + late_b0)
        sent = first + more_b0 + b1 + late_b0

        # MongoDB comes back once B0 ended more than span + max_late ago.
        back = b0 + (120 + max_late + 3) * NS
        while time.time_ns() < back:
            time.sleep(min(1.0, (back - time.time_ns()) / NS + 0.01))
        proxy.set_fault("pass")
        st = self.settle(client, db, len(sent), d)
        docs = self.documents(client, db)
        pages = sorted((doc["bucket_start"], doc["page"], doc["count"]) for doc in docs)
        self.assertTrue(all(n <= 5 for _, _, n in pages), "pages over the cap of 5: %s" % pages)
        self.assertExactlyOnce(docs, sent, daemon=d)
        self.assertNoProblems(bdtest.check_documents(docs, 60, 5, strict_pages=False),
                              "invariants", d)
        self.assertStat(st, "readings_lost", 0, d)
        rc, out = bdtest.inspect_verify(uri, db, 5, "1m")
        self.assertEqual(rc, 0, "bucketd-inspect verify:\n%s" % out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
