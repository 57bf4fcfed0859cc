#!/usr/bin/python3
"""End-to-end: the summary documents (README "Dashboard queries"): one document per sensor and
bucket in <collection>_summary, holding the bucket's totals over all its pages, recomputed by
the daemon after its pages change; the dashboard query of the README reads them by index.

Expected values come from the readings each test sent, never from the page documents.

Run: /usr/bin/python3 tests/e2e/test_summaries.py   (environment: see bdtest.py)
"""

import datetime
import math
import os
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

from bson.int64 import Int64  # noqa: E402

SPAN_S = 3600
NS_PER_S = 1000 * 1000 * 1000
DEADLINE = 120.0
MAX_READINGS = 7  # several pages per bucket


def hour_start(offset_hours):
    """Unix seconds of the start of the hour offset_hours from the current one."""
    now = time.time_ns() // NS_PER_S
    return (now // SPAN_S + offset_hours) * SPAN_S


class Expected:
    """The summaries the readings sent must produce: per (sensor, bucket start s)."""

    def __init__(self):
        self.buckets = {}

    def add(self, sensor, ts_ns, fields):
        b = self.buckets.setdefault((sensor, ts_ns // NS_PER_S // SPAN_S * SPAN_S),
                                    {"count": 0, "fields": {}})
        b["count"] += 1
        for name, value in fields.items():
            if isinstance(value, bool):
                continue  # booleans are stored, not summarised
            f = b["fields"].setdefault(name, [])
            f.append(value)


def datetime_of(unix_s):
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc)


def line(sensor, fields, ts_ns):
    parts = []
    for k, v in fields.items():
        if isinstance(v, bool):
            parts.append("%s=%s" % (k, "true" if v else "false"))
        elif isinstance(v, int):
            parts.append("%s=%di" % (k, v))
        else:
            parts.append("%s=%r" % (k, v))
    return ("%s %s %d\n" % (sensor, ",".join(parts), ts_ns)).encode()


def inspect(*args):
    if not os.access(bdtest.INSPECT, os.X_OK):
        raise AssertionError("bucketd-inspect not found at %s (set BUCKETD_INSPECT_BIN)"
                             % bdtest.INSPECT)
    p = subprocess.run([bdtest.INSPECT] + [str(a) for a in args], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=120)
    return p.returncode, (p.stdout + p.stderr).decode("utf-8", "replace")


class SummaryDocuments(bdtest.E2ECase):
    db_prefix = "summaries"

    def start_daemon(self, uri, db, name="d", interval="1s"):
        d = self.daemon(uri, db, name=name, max_readings=MAX_READINGS,
                        extra={"summaries": {"interval": interval}})
        d.start()
        return d

    def send(self, d, expected, lines_spec):
        """lines_spec: (sensor, ts_ns, fields) over TCP; recorded in expected."""
        with socket.create_connection(d.addr("tcp"), timeout=DEADLINE) as tcp:
            for sensor, ts_ns, fields in lines_spec:
                tcp.sendall(line(sensor, fields, ts_ns))
                expected.add(sensor, ts_ns, fields)

    def readings(self, sensors, hours, n, first=0):
        """n readings per sensor and hour: a float, an int missing from every third reading,
        a boolean; every fifth reading has the boolean alone."""
        out = []
        for s in sensors:
            for h in hours:
                base = hour_start(h) * NS_PER_S
                for i in range(first, first + n):
                    ts = base + (i * 7 + 1) * NS_PER_S
                    if i % 5 == 4:
                        fields = {"ok": True}
                    else:
                        fields = {"temp": 20.0 + ((i * 37) % 11) * 0.25 - len(s) % 3, "ok": False}
                        if i % 3:
                            fields["hum"] = 40 + (i * 13) % 17
                    out.append((s, ts, fields))
        return out

    def assertSummaries(self, client, db, expected, d=None):
        coll = client[db]["buckets_summary"]
        docs = list(coll.find({}))
        got = {(doc["sensor_id"], bdtest.dt_ms(doc["bucket_start"]) // 1000): doc
               for doc in docs}
        self.assertEqual(len(got), len(docs), "one summary document per sensor and bucket")
        self.assertEqual(sorted(got), sorted(expected.buckets))
        pages = client[db]["buckets"]
        for key, want in expected.buckets.items():
            doc = got[key]
            sensor, start = key
            self.assertEqual(doc["count"], want["count"], key)
            self.assertIsInstance(doc["count"], Int64, key)
            # Consistent with the pages stored, and several of them (max_readings 7).
            self.assertEqual(doc["pages"],
                             pages.count_documents({"sensor_id": sensor,
                                                    "bucket_start": doc["bucket_start"]}), key)
            self.assertEqual(doc["pages"], math.ceil(want["count"] / MAX_READINGS), key)
            self.assertEqual(bdtest.dt_ms(doc["bucket_end"]), (start + SPAN_S) * 1000 - 1, key)
            self.assertEqual(doc["meta"]["measurement"], sensor.split(",")[0], key)
            self.assertEqual(sorted(doc["summary"]), sorted(want["fields"]), key)
            for name, values in want["fields"].items():
                s = doc["summary"][name]
                self.assertEqual(s["count"], len(values), (key, name))
                self.assertEqual(s["min"], min(values), (key, name))
                self.assertEqual(s["max"], max(values), (key, name))
                self.assertIs(type(s["min"]), Int64 if isinstance(values[0], int) else float,
                              (key, name, "min/max keep the readings' type"))
                self.assertAlmostEqual(s["sum"], float(sum(values)), delta=1e-9 * len(values))
                self.assertAlmostEqual(s["avg"], sum(values) / len(values), delta=1e-9)

    def test_summaries_hold_every_page_of_their_bucket_across_restarts(self):
        uri, client, db = self.new_database()
        expected = Expected()
        sensors = ["room,floor=1", "room,floor=2", "pump"]
        d = self.start_daemon(uri, db)
        spec = self.readings(sensors, [-2, -1], 16)
        self.send(d, expected, spec)
        self.assertEqual(bdtest.wait_stored(client, db, len(spec), DEADLINE), len(spec))
        stats = d.stop()
        self.assertStat(stats, "readings_flushed", len(spec), d)
        self.assertSummaries(client, db, expected, d)
        self.assertGreaterEqual(stats["summary_buckets_refreshed"], len(expected.buckets))
        self.assertStat(stats, "summary_buckets_skipped", 0, d)
        self.assertStat(stats, "summary_refresh_errors", 0, d)
        ids = {(doc["sensor_id"], doc["bucket_start"]): doc["_id"]
               for doc in client[db]["buckets_summary"].find({})}

        # A second run adds readings to one bucket of the first: its summary covers both runs
        # and keeps its _id.
        d2 = self.start_daemon(uri, db, name="d2")
        more = self.readings(sensors[:1], [-1], 9, first=16)
        self.send(d2, expected, more)
        total = len(spec) + len(more)
        self.assertEqual(bdtest.wait_stored(client, db, total, DEADLINE), total)
        d2.stop()
        self.assertSummaries(client, db, expected, d2)
        for doc in client[db]["buckets_summary"].find({}):
            self.assertEqual(doc["_id"], ids[(doc["sensor_id"], doc["bucket_start"])])

        # The unique index $merge needs, and the README's dashboard query: one document per
        # hour, in order.
        idx = {i["name"]: i for i in client[db]["buckets_summary"].list_indexes()}
        self.assertTrue(idx["sensor_id_1_bucket_start_1"].get("unique"), idx)
        start = hour_start(-2)
        q = list(client[db]["buckets_summary"].find(
            {"sensor_id": "room,floor=1",
             "bucket_start": {"$gte": datetime_of(start),
                              "$lt": datetime_of(start + 2 * SPAN_S)}},
            {"_id": 0, "bucket_start": 1, "count": 1, "summary.temp": 1}).sort("bucket_start", 1))
        self.assertEqual([bdtest.dt_ms(x["bucket_start"]) // 1000 for x in q],
                         [start, start + SPAN_S])
        self.assertEqual([x["count"] for x in q],
                         [expected.buckets[("room,floor=1", start)]["count"],
                          expected.buckets[("room,floor=1", start + SPAN_S)]["count"]])
        self.check_inspect(uri, client, db, expected)

    def check_inspect(self, uri, client, db, expected):
        """verify --summaries finds stale, missing and orphaned summaries; summaries rebuild
        repairs the first two."""
        conn = ["--uri", uri, "--database", db]
        verify = conn + ["verify", "--summaries", "--max-readings", MAX_READINGS]
        rc, out = inspect(*verify)
        self.assertEqual(rc, 0, out)
        self.assertIn(", %d summaries: 0 problems" % len(expected.buckets), out)

        summaries = client[db]["buckets_summary"]
        start = hour_start(-2)
        when = datetime_of(start)
        summaries.update_one({"sensor_id": "pump", "bucket_start": when},
                             {"$inc": {"count": 1}, "$set": {"summary.temp.max": 99.5}})
        summaries.delete_one({"sensor_id": "room,floor=2", "bucket_start": when})
        summaries.insert_one({"sensor_id": "gone", "bucket_start": when, "count": Int64(1)})
        rc, out = inspect(*verify)
        self.assertEqual(rc, 1, out)
        want_count = expected.buckets[("pump", start)]["count"]
        self.assertIn("summary pump|%d: count is not the readings of the bucket's pages "
                      "(expected %d, found %d)" % (start, want_count, want_count + 1), out)
        self.assertIn("summary pump|%d: summary.temp.max is wrong" % start, out)
        self.assertIn("summary room,floor=2|%d: no summary document for this bucket" % start, out)
        self.assertIn("summary gone|%d: warning: summary of a bucket without pages" % start, out)
        self.assertIn(": 3 problems, 1 warnings", out)

        rc, out = inspect(*(conn + ["summaries", "rebuild", "--from", start,
                                    "--to", start + SPAN_S]))
        self.assertEqual(rc, 0, out)
        self.assertIn("4 summary documents in %s.buckets_summary for this range" % db, out)
        rc, out = inspect(*verify)
        self.assertEqual(rc, 0, out)
        self.assertIn(": 0 problems, 1 warnings", out)
        summaries.delete_one({"sensor_id": "gone"})
        self.assertSummaries(client, db, expected)

    def test_summaries_follow_the_pages_while_the_daemon_runs(self):
        uri, client, db = self.new_database()
        expected = Expected()
        d = self.start_daemon(uri, db, interval="500ms")
        spec = self.readings(["tank,id=7"], [-1], 12)
        self.send(d, expected, spec)
        key = ("tank,id=7", hour_start(-1))
        want = expected.buckets[key]["count"]
        coll = client[db]["buckets_summary"]

        def refreshed():
            doc = coll.find_one({"sensor_id": key[0]})
            return doc is not None and doc["count"] == want

        self.assertTrue(bdtest.wait_for(refreshed, DEADLINE),
                        "summary not refreshed while running\n" + bdtest.log_tail(d.log()))
        self.assertSummaries(client, db, expected, d)
        d.stop()

    def test_a_failed_refresh_is_retried_and_delays_no_reading(self):
        uri, client, db = self.new_database()
        self.addCleanup(lambda: client.admin.command("configureFailPoint", "failCommand",
                                                    mode="off"))
        client.admin.command("configureFailPoint", "failCommand", mode={"times": 2},
                             data={"failCommands": ["aggregate"], "appName": "bucketd",
                                   "errorCode": 91})
        expected = Expected()
        d = self.start_daemon(uri, db, interval="500ms")
        spec = self.readings(["valve,n=1", "valve,n=2"], [-1], 10)
        self.send(d, expected, spec)
        # The readings are written whatever the refreshes do.
        self.assertEqual(bdtest.wait_stored(client, db, len(spec), DEADLINE), len(spec))
        coll = client[db]["buckets_summary"]

        def refreshed():
            return sum(int(x["count"]) for x in coll.find({})) == len(spec)

        self.assertTrue(bdtest.wait_for(refreshed, DEADLINE),
                        "summaries not refreshed after the failures\n" + bdtest.log_tail(d.log()))
        entered = client.admin.command("configureFailPoint", "failCommand", mode="off")["count"]
        stats = d.stop()
        self.assertEqual(entered, 2)
        self.assertStat(stats, "summary_refresh_errors", 2, d)
        self.assertStat(stats, "readings_flushed", len(spec), d)
        self.assertStat(stats, "summary_buckets_skipped", 0, d)
        self.assertSummaries(client, db, expected, d)
        self.assertTrue(any("refreshing the summary documents of" in l for l in d.log_lines()),
                        bdtest.log_tail(d.log()))

    def test_summaries_off_writes_no_summary_document(self):
        uri, client, db = self.new_database()
        d = self.start_daemon(uri, db, interval="0s")
        expected = Expected()
        spec = self.readings(["quiet"], [-1], 5)
        self.send(d, expected, spec)
        self.assertEqual(bdtest.wait_stored(client, db, len(spec), DEADLINE), len(spec))
        stats = d.stop()
        self.assertStat(stats, "summary_refreshes", 0, d)
        self.assertEqual(client[db]["buckets_summary"].count_documents({}), 0)


class SummaryDocumentsSharded(SummaryDocuments):
    """The same, with the test server strict like mongos (every collection sharded on
    {sensor_id, bucket_start}): $merge's "on" holds the shard key."""

    mongo_options = {"sharded": "sensor_id:1,bucket_start:1"}


if __name__ == "__main__":
    unittest.main()
