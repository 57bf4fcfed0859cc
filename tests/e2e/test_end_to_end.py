#!/usr/bin/python3
"""End-to-end: readings in over UDP and TCP (influx and graphite), bucket documents out.

No assertion depends on how fast anything runs: before a count is checked, the test waits (with
a generous deadline, asserted) until the documents hold every reading sent, and "late" readings
are sent only once the others are stored.

Run: /usr/bin/python3 tests/e2e/test_end_to_end.py   (see bdtest.py for the environment)
"""

import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402
from bdtest import send_readings as sr  # noqa: E402

SPAN_S = 3600
FLUSH_S = 0.2
# Deadline for readings sent to be stored (a bound on a wait, never asserted as a duration).
STORE_DEADLINE = 120.0


def bucket_starts(docs):
    return sorted({bdtest.dt_ms(d["bucket_start"]) for d in docs})


class EndToEnd(bdtest.E2ECase):
    db_prefix = "e2e"

    def assertStored(self, client, db, n, daemon):
        """Wait until the documents hold exactly n readings (every one sent so far)."""
        stored = bdtest.wait_stored(client, db, n, STORE_DEADLINE)
        if stored != n:
            self.fail("the documents hold %d readings, %d were sent (waited up to %ds)\n"
                      "--- log tail %s ---\n%s" % (stored, n, STORE_DEADLINE, daemon.log_path,
                                                   bdtest.log_tail(daemon.log(), 30)))

    def send_then_late(self, daemon, client, db, main, late, **kw):
        """Send main, wait until it is stored, then send late (so the newer buckets of the
        same sensors were written before the late readings came) and wait for those too.
        Returns the two summaries added up."""
        kw.setdefault("udp", daemon.addr("udp"))
        kw.setdefault("tcp", daemon.addr("tcp"))
        first = sr.send(main, **kw)
        self.assertStored(client, db, len(main), daemon)
        second = sr.send(late, **kw)
        self.assertStored(client, db, len(main) + len(late), daemon)
        return {k: first[k] + second[k] for k in ("readings", "datagrams", "bytes")}

    def test_exactly_once_udp_tcp_graphite(self):
        """Thousands of shuffled readings, some late: each stored once, in its own bucket."""
        uri, client, db = self.new_database("e2e_once")
        d = self.daemon(uri, db, listeners=[
            {"name": "udp", "proto": "udp", "format": "influx", "precision": "ns"},
            {"name": "tcp", "proto": "tcp", "format": "influx", "precision": "ns"},
            {"name": "graphite", "proto": "tcp", "format": "graphite", "precision": "s"},
        ])
        # 30 influx sensors x 200 readings over the 3 hours up to a minute ago: even sensors
        # over UDP (4 lines per datagram), odd ones over TCP.
        influx = sr.make_readings(sensors=30, per_sensor=200, seed=11)
        # Two meters (one per transport) with an unsigned field and, every 10th reading, a
        # string field that bucketd drops and counts.
        meters = sr.make_readings(sensors=2, per_sensor=50, seed=12, prefix="meter",
                                  unsigned=True, string_every=10, seq_base=len(influx))
        graphite = sr.make_readings(sensors=4, per_sensor=100, fmt="graphite", seed=13,
                                    seq_base=len(influx) + len(meters))
        everything = influx + meters + graphite
        strings_sent = sum(1 for r in meters if b'note="' in r.line)
        self.assertGreater(strings_sent, 0)

        main, late = sr.split_late(sr.shuffle(influx + meters, seed=5), fraction=0.1, seed=5)
        self.assertGreater(len(late), 10)
        g_main, g_late = sr.split_late(sr.shuffle(graphite, seed=6), fraction=0.1, seed=6)

        d.start()
        with sr.Sender(udp=d.addr("udp"), tcp=d.addr("tcp"), lines_per_datagram=4) as s, \
                sr.Sender(tcp=d.addr("graphite")) as g:
            for r in main:
                s.send_reading(r)
            for r in g_main:
                g.tcp_line(r.line)
            s.flush()
            g.flush()
            # Late readings: sent once everything else is stored, so after the newer buckets of
            # their sensors have been written.
            self.assertStored(client, db, len(main) + len(g_main), d)
            for r in late:
                s.send_reading(r)
            for r in g_late:
                g.tcp_line(r.line)
            s.flush()
            g.flush()
            sent = s.summary()
            gsent = g.summary()
        self.assertStored(client, db, len(everything), d)
        self.assertTrue(d.alive(), "bucketd died while receiving")
        stats = d.stop()
        self.assertIsNotNone(stats, "no stats line")

        n_sent = sent["readings"] + gsent["readings"]
        self.assertEqual(n_sent, len(everything))
        # Kernel-level loss would make everything below fail confusingly: check it first.
        self.assertStat(stats, "udp_datagrams", sent["datagrams"], d)
        self.assertStat(stats, "readings_accepted", n_sent, d)
        self.assertStat(stats, "readings_flushed", n_sent, d)
        self.assertStat(stats, "string_fields_dropped", strings_sent, d)
        for name, value in sorted(stats.items()):
            if name.startswith("drop_"):
                self.assertStat(stats, name, 0, d)
        self.assertStat(stats, "readings_lost", 0, d)
        self.assertStat(stats, "updates_quarantined", 0, d)

        docs = self.documents(client, db)
        self.assertEqual(sum(doc["count"] for doc in docs), n_sent)
        self.assertGreaterEqual(len(bucket_starts(docs)), 3,
                                "readings should cross at least two hour boundaries")
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, 3600), "invariants", d)
        self.assertNoProblems(bdtest.check_readings(docs, everything, SPAN_S), "readings", d)
        # Late readings belong to buckets older than the newest one, written before they came
        # (check_readings above proved each landed in the bucket of its own timestamp).
        newest = bucket_starts(docs)[-1]
        self.assertTrue(all(r.ts_ms // 3600000 * 3600000 < newest for r in late))
        sensors = {doc["sensor_id"] for doc in docs}
        self.assertEqual(sensors, {r.sensor_id for r in everything})
        # Canonical graphite ids: tags sorted.
        self.assertIn("plant.s001.temp;room=r01;site=lab1", sensors)

    def test_overflow_pages(self):
        """max_readings 50: full pages 0..k-1, a partial last page, every invariant holds."""
        uri, client, db = self.new_database("e2e_pages")
        cap = 50
        d = self.daemon(uri, db, max_readings=cap)
        now = time.time_ns()
        span = 2 * 3600 * sr.NS_PER_S
        readings = sr.make_readings(sensors=10, per_sensor=300, seed=21,
                                    start_ns=now - span - 60 * sr.NS_PER_S, span_ns=span)
        main, late = sr.split_late(sr.shuffle(readings, seed=22), fraction=0.1, seed=22)
        d.start()
        summary = self.send_then_late(d, client, db, main, late, lines_per_datagram=8)
        stats = d.stop()
        self.assertStat(stats, "udp_datagrams", summary["datagrams"], d)
        self.assertStat(stats, "readings_accepted", len(readings), d)
        self.assertStat(stats, "readings_flushed", len(readings), d)

        docs = self.documents(client, db)
        self.assertEqual(sum(doc["count"] for doc in docs), len(readings))
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, cap, strict_pages=True),
                              "invariants", d)
        self.assertNoProblems(bdtest.check_readings(docs, readings, SPAN_S), "readings", d)
        self.assertGreaterEqual(max(doc["page"] for doc in docs), 2,
                                "expected buckets with at least three pages")
        # Every (sensor, bucket) with more than cap readings got ceil(n / cap) pages.
        per_bucket = {}
        for r in readings:
            key = (r.sensor_id, r.ts_ms // 3600000 * 3600)
            per_bucket[key] = per_bucket.get(key, 0) + 1
        pages = {}
        for doc in docs:
            key = (doc["sensor_id"], bdtest.dt_ms(doc["bucket_start"]) // 1000)
            pages[key] = pages.get(key, 0) + 1
        for key, n in per_bucket.items():
            self.assertEqual(pages.get(key), -(-n // cap), "pages of %s (%d readings)" % (key, n))

    def test_page_caps_hold_across_many_open_buckets(self):
        """20 hours of buckets written, then all revisited: every page keeps its cap."""
        uri, client, db = self.new_database("e2e_many_buckets")
        cap = 10
        d = self.daemon(uri, db, max_readings=cap)
        now = time.time_ns()
        span = 20 * 3600 * sr.NS_PER_S
        readings = sr.make_readings(sensors=2, per_sensor=600, seed=31,
                                    start_ns=now - span - 60 * sr.NS_PER_S, span_ns=span)
        # Half of every bucket first; the other half after those pages were flushed, so each
        # of the ~20 buckets per sensor is reopened after its newer neighbours.
        first, second = sr.split_late(sr.shuffle(readings, seed=32), fraction=0.5, seed=32)
        d.start()
        self.send_then_late(d, client, db, first, second, lines_per_datagram=8)
        stats = d.stop()
        self.assertStat(stats, "readings_flushed", len(readings), d)
        docs = self.documents(client, db)
        self.assertGreaterEqual(len({bdtest.dt_ms(doc["bucket_start"]) for doc in docs}), 20)
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, cap, strict_pages=True),
                              "invariants", d)
        self.assertNoProblems(bdtest.check_readings(docs, readings, SPAN_S), "readings", d)

    def test_tcp_backpressure_does_not_drop(self):
        """A tiny buffer pool: TCP stops reading instead of dropping; every reading arrives."""
        uri, client, db = self.new_database("e2e_backpressure")
        # 128 segments of 1 KiB, congested past 96: the 8,000 readings of 3 fields (4 cells
        # each) take about 540 segments, so the connection pauses again and again.
        d = self.daemon(uri, db, extra={"limits": {"memory": "256KiB"}})
        readings = sr.make_readings(sensors=4, per_sensor=2000, seed=61)
        d.start()
        started = time.monotonic()
        sr.send(sr.shuffle(readings, seed=62), tcp=d.addr("tcp"))
        self.assertStored(client, db, len(readings), d)
        stats = d.stop()
        elapsed = time.monotonic() - started
        # A pool this small passes its marks many times a second; those wake-ups only drain,
        # the writes still come once per flush interval (plus the final one at stop), or early
        # when the pending batches reach their half of limits.memory (counted apart). A slow
        # machine only makes the bound larger.
        self.assertLessEqual(int(stats["bulk_writes"]),
                             elapsed / FLUSH_S + 2 + int(stats["flushes_for_memory"]),
                             "writes per flush interval")
        self.assertStat(stats, "drop_buffer_full", 0, d)
        self.assertStat(stats, "readings_accepted", len(readings), d)
        self.assertStat(stats, "readings_flushed", len(readings), d)
        docs = self.documents(client, db)
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, 3600), "invariants", d)
        self.assertNoProblems(bdtest.check_readings(docs, readings, SPAN_S), "readings", d)

    def test_indexes_created_at_startup(self):
        """The upsert/query index {sensor_id: 1, bucket_start: 1} exists once bucketd runs."""
        uri, client, db = self.new_database("e2e_index")
        d = self.daemon(uri, db)
        d.start()
        coll = client[db]["buckets"]

        def has_index():
            try:
                for ix in coll.list_indexes():
                    keys = list(ix["key"].items())
                    if [(k, int(v)) for k, v in keys[:2]
                            if not isinstance(v, str)] == [("sensor_id", 1), ("bucket_start", 1)]:
                        return ix
            except Exception:  # collection not created yet
                return None
            return None

        ix = bdtest.wait_for(has_index, 60.0, 0.2)
        indexes = []
        try:
            indexes = [dict(i) for i in coll.list_indexes()]
        except Exception as e:
            indexes = ["list_indexes failed: %s" % e]
        self.assertTrue(d.alive())
        d.stop()
        self.assertTrue(ix, "no {sensor_id: 1, bucket_start: 1} index; indexes: %r\n%s" % (
            indexes, bdtest.log_tail(d.log(), 20)))

    def test_write_amplification(self):
        """One update per bucket page per flush, however the readings spread over the flushes.

        How far below the readings the updates stay depends on how many readings arrive per
        flush interval, i.e. on the machine's speed: that ratio is measured by bench/suite.py
        (figure 6, updates per reading), not asserted here."""
        uri, client, db = self.new_database("e2e_amp")
        d = self.daemon(uri, db)
        readings = sr.make_readings(sensors=20, per_sensor=300, seed=31)
        d.start()
        sr.send(sr.shuffle(readings, seed=32), tcp=d.addr("tcp"))
        self.assertStored(client, db, len(readings), d)
        stats = d.stop()
        self.assertStat(stats, "readings_flushed", len(readings), d)
        docs = self.documents(client, db)
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, 3600), "invariants", d)
        updates, flushes = stats.get("updates_sent"), stats.get("flushes")
        self.assertIsNotNone(updates)
        self.assertIsNotNone(flushes)
        sys.stderr.write("\nwrite amplification: %d readings, %d docs, %d updates, %d flushes, "
                         "%d bulk writes\n" % (len(readings), len(docs), updates, flushes,
                                               stats.get("bulk_writes", -1)))
        self.assertGreaterEqual(updates, len(docs), "every document needs at least one update")
        self.assertLessEqual(updates, flushes * len(docs),
                             "more than one update per bucket page per flush")
        self.assertGreaterEqual(stats.get("bulk_writes", 0), 1)
        self.assertLessEqual(stats.get("bulk_writes", 0), updates)


if __name__ == "__main__":
    unittest.main(verbosity=2)
