#!/usr/bin/python3
"""Flusher regressions: one test per defect of the flusher found with the test server's and the
fault proxy's new abilities (16 MiB documents, validators, fail points, racing inserts).

Each test states the behaviour DESIGN.md §3 promises and, in its docstring, how the flusher of
18e0a24 (before the flusher was split into outcome/pages/batch/store) failed it, with the
numbers of a run here. Five reproduce a defect of 18e0a24 (the two oversized-page tests, the
writer_id clash after a nothing-sent failure, the page cap across an outage, long names); the
other four passed there already and guard what the rewrite must keep (a racing page of another
writer, a validator refusing one sensor, errors that fail or only half-fail a write).
Expectations come from what the test sent; waits are on stored readings, log lines or the
proxy's counters, never on the clock alone. Each takes well under a minute; the one that
cannot (the page cap across an outage longer than a span, 85 to 150 s) is in
test_flusher_long_outage.py, which runs with the other long suites (label e2e_long).
SplitBulkByCount and SplitBulkByBytes reproduce a defect of 0bed50e (a bulk libmongoc split
into several commands, one failing whole after another answered a duplicate key, was counted
stored), each with a test server of its own (maxWriteBatchSize 2, and the default).
test_sensor_whose_readings_are_held_is_not_evicted reproduces a defect of 324dd31 (a sensor
evicted while the flusher held its readings came back as a second sensor writing the same page
under the same sequence number: a false writer conflict).

Run: /usr/bin/python3 tests/e2e/test_flusher_regressions.py
Environment (besides bdtest.py's): BUCKETD_INSPECT_BIN. With BUCKETD_TEST_MONGODB_URI the same
tests run against a real MongoDB; the fail point tests then need it started with
--setParameter enableTestCommands=1.
"""

import collections
import datetime
import os
import signal
import socket
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for fault_proxy

import bdtest  # noqa: E402
import send_readings  # noqa: E402  (tools/send_readings.py, on bdtest's path)

import bson  # noqa: E402
import pymongo.errors  # noqa: E402
from bson.int64 import Int64  # noqa: E402

INSPECT = bdtest.INSPECT
NS = 1_000_000_000
MS = 1_000_000
HOUR_S = 3600
DEADLINE = 60           # seconds to wait for an event that should come in a few
MAX_BSON = 16 * 1024 * 1024
WRITER = "regress"      # writer_id of every daemon here


# ---------------------------------------------------------------------------------------------
# Readings and checks
# ---------------------------------------------------------------------------------------------

def reading(sensor_id, measurement, tags, seq, ts_ns, fields, seq_field="seq"):
    """A send_readings.Reading for an influx line with the given fields (name -> value; ints
    are sent as i-integers, floats as floats). fields must include seq_field = seq."""
    assert fields[seq_field] == seq
    head = measurement + "".join(",%s=%s" % (k, v) for k, v in sorted(tags.items()))
    parts = []
    for name, value in fields.items():
        parts.append("%s=%di" % (name, value) if isinstance(value, int) else
                     "%s=%r" % (name, value))
    line = "%s %s %d" % (head, ",".join(parts), ts_ns)
    return send_readings.Reading(0, sensor_id, measurement, tags, seq, ts_ns, dict(fields),
                                 line.encode(), "influx")


def send_tcp(addr, readings):
    summary = send_readings.send(readings, tcp=addr)
    assert summary["readings"] == len(readings), summary
    return summary


def dt_of_ms(ms):
    return datetime.datetime(1970, 1, 1) + datetime.timedelta(milliseconds=ms)


def hour_aligned_base(length_ns, before_ns):
    """A start time about before_ns ago such that [start, start + length_ns) lies in one hour
    (the next hour's start, a little in the future, if now is too close to the hour)."""
    base = time.time_ns() - before_ns
    hour = HOUR_S * NS
    if base // hour != (base + length_ns) // hour:
        base = (base // hour + 1) * hour
    return base


def seq_counts(docs, seq_field_of):
    """Counter of (sensor_id, sequence number) over every stored reading."""
    out = collections.Counter()
    for doc in docs:
        sid = doc.get("sensor_id")
        name = seq_field_of(sid)
        for r in doc.get("readings") or []:
            out[(sid, r.get(name))] += 1
    return out


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------

class RegressionCase(bdtest.E2ECase):
    """The helpers of these tests (no test of its own); test_flusher_long_outage.py uses them
    too."""
    db_prefix = "e2e_regress"

    @classmethod
    def setUpClass(cls):
        if not os.access(INSPECT, os.X_OK):
            raise AssertionError("%s not found (set BUCKETD_INSPECT_BIN)" % INSPECT)

    # -- helpers ------------------------------------------------------------------------------

    def new_daemon(self, uri, db, max_readings=3600, flush_interval="200ms", extra=None,
                   name="d"):
        cfg = {"writer_id": WRITER,
               "flush": {"retry_initial": "50ms", "retry_max": "1s"}}
        cfg = bdtest.deep_merge(cfg, extra or {})
        return self.daemon(uri, db, name=name, max_readings=max_readings,
                           flush_interval=flush_interval, extra=cfg,
                           listeners=[{"name": "tcp", "proto": "tcp", "format": "influx"}])

    def proxy_for(self, uri, client):
        """A fault proxy in front of the server, and the URI the daemon uses through it."""
        return bdtest.start_fault_proxy(self, uri, client)

    def go_unreachable(self, proxy, d):
        """Refuse connections, and wait until the daemon's driver has tried one (its monitor
        then knows the server is down): from here a write fails at server selection, with
        nothing sent."""
        proxy.set_fault("refuse")
        self.assertTrue(bdtest.wait_for(lambda: proxy.stats()["connections_refused"] >= 1,
                                        DEADLINE), "the driver never tried to reconnect\n" +
                        bdtest.log_tail(d.log(), 20))

    def fail_point(self, client, mode, **data):
        """failCommand on the server (not through any proxy); off again after the test."""
        self.addCleanup(lambda: client.admin.command("configureFailPoint", "failCommand",
                                                    mode="off"))
        return client.admin.command("configureFailPoint", "failCommand", mode=mode, data=data)

    def wait_log(self, d, what, pred, since=0, timeout=DEADLINE):
        """Wait until a log line after offset `since` satisfies pred; returns it or None."""
        def find():
            for line in d.log()[since:].splitlines():
                if pred(line):
                    return line
            return None
        return bdtest.wait_for(find, timeout, 0.1)

    def wait_stored(self, client, db, n, d, timeout=DEADLINE):
        stored = bdtest.wait_stored(client, db, n, timeout)
        self.assertEqual(stored, n, "readings stored (waited up to %ds)\n%s" % (
            timeout, bdtest.log_tail(d.log(), 40)))

    def settle(self, client, db, n, d, timeout=DEADLINE):
        """Wait (up to timeout) until n readings are stored, then stop the daemon; returns
        its stats.  The count is asserted after the stop, so that a failure shows the
        daemon's counters."""
        stored = bdtest.wait_stored(client, db, n, timeout)
        st = d.stop()
        self.assertEqual(stored, n, "readings stored (waited up to %ds); stats %r\n%s" % (
            timeout, st, bdtest.log_tail(d.log(), 20)))
        return st

    def assertExactlyOnce(self, docs, sent, seq_field_of=lambda sid: "seq", daemon=None):
        """Every reading sent stored once, nothing else stored."""
        want = collections.Counter((r.sensor_id, r.seq) for r in sent)
        got = seq_counts(docs, seq_field_of)
        twice = sorted(k for k, n in got.items() if n > 1)
        extra = sorted((k for k in got if k not in want), key=repr)
        missing = sorted(k for k in want if k not in got)
        log = "" if daemon is None else "\n" + bdtest.log_tail(daemon.log(), 40)
        self.assertEqual(
            (len(missing), len(twice), len(extra)), (0, 0, 0),
            "of %d readings sent: %d missing (e.g. %s), %d stored twice (e.g. %s), %d never "
            "sent (e.g. %s)%s" % (len(want), len(missing), [m[1] for m in missing[:5]],
                                  len(twice), twice[:3], len(extra), extra[:3], log))

    def assertPagesBounded(self, docs, max_readings):
        for doc in docs:
            size = len(bson.encode(doc))
            self.assertLess(size, MAX_BSON, "%s: %d bytes" % (str(doc["_id"])[:80], size))
            self.assertLessEqual(len(doc.get("readings") or []), max_readings, doc["_id"])
            self.assertEqual(doc.get("count"), len(doc.get("readings") or []), doc["_id"])



class FlusherRegressions(RegressionCase):
    # -- 1. updates over 16 MiB ---------------------------------------------------------------

    def test_oversized_update_is_split_not_lost(self):
        """3,000 readings of 32 fields with 200-character names from one sensor in one flush
        (20 MB of BSON: no single update can carry them), beside five ordinary sensors.

        On 18e0a24: the bulk never succeeds. libmongoc refuses it before sending ("Document 0
        is too large for the cluster. Document is 20311738 bytes, max is 16777216."), the
        flusher takes that for an ambiguous failure and retries the whole bulk, the five small
        sensors' updates with it, until the stop deadline: 168 bulk attempts, stored 0 of
        3,200, readings_flushed=0, readings_lost=3200."""
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db, flush_interval="5s",
                            extra={"limits": {"memory": "256MiB"}}).start()
        names = ["f%02d_" % i + "n" * 196 for i in range(32)]
        self.assertTrue(all(len(n) == 200 for n in names))
        base = hour_aligned_base(10 * NS, 120 * NS)
        big = []
        for k in range(3000):
            fields = {names[0]: k + 1}
            fields.update((n, float(i) + k / 1000.0) for i, n in enumerate(names[1:], 1))
            big.append(reading("wide,sensor=big", "wide", {"sensor": "big"}, k + 1,
                               base + k * MS, fields, seq_field=names[0]))
        small = send_readings.make_readings(sensors=5, per_sensor=40, start_ns=base,
                                            span_ns=5 * NS, prefix="plain", seq_base=10000)
        send_tcp(d.addr("tcp"), big + small)
        sent = big + small
        self.assertEqual(len(sent), 3200)
        st = self.settle(client, db, 3200, d, timeout=90)
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, sent, lambda sid: names[0] if sid.startswith("wide")
                               else "seq", d)
        self.assertPagesBounded(docs, 3600)
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 3600, strict_pages=False),
                              "invariants", d)
        for name in ("updates_quarantined", "readings_lost"):
            self.assertStat(st, name, 0, d)
        self.assertStat(st, "readings_flushed", 3200, d)
        rc, out = bdtest.inspect_verify(uri, db, 3600)
        self.assertEqual(rc, 0, "bucketd-inspect verify:\n%s" % out)

    def test_oversized_page_of_short_fields(self):
        """100,000 readings of 10 short fields with buckets.max_readings 100000: one page by
        count, 19 MB by bytes, so it must be split across pages.

        On 18e0a24: as above ("Document is 18994377 bytes, max is 16777216"), retried until
        the stop deadline: 159 bulk attempts, stored 0 of 100,000, readings_lost=100000."""
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db, max_readings=100000, flush_interval="5s",
                            extra={"limits": {"memory": "256MiB"}}).start()
        names = ["seq"] + ["value_%d" % i for i in range(1, 10)]
        base = hour_aligned_base(110 * NS, 150 * NS)
        sent = []
        for k in range(100000):
            fields = {"seq": k + 1}
            fields.update((n, float(i) + (k % 1000) / 8.0) for i, n in enumerate(names[1:], 1))
            sent.append(reading("narrow,sensor=n1", "narrow", {"sensor": "n1"}, k + 1,
                                base + k * MS, fields))
        send_tcp(d.addr("tcp"), sent)
        st = self.settle(client, db, 100000, d, timeout=90)
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, sent, daemon=d)
        self.assertPagesBounded(docs, 100000)
        self.assertGreater(len(docs), 1, "19 MB of readings cannot be one document")
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 100000, strict_pages=False),
                              "invariants", d)
        for name in ("updates_quarantined", "readings_lost"):
            self.assertStat(st, name, 0, d)
        self.assertStat(st, "readings_flushed", 100000, d)
        rc, out = bdtest.inspect_verify(uri, db, 100000)
        self.assertEqual(rc, 0, "bucketd-inspect verify:\n%s" % out)

    # -- 2. nothing sent is not "maybe applied" -----------------------------------------------

    def run_nothing_sent_then_race(self, racing_w, spooled=False):
        """Five readings fill page 0; MongoDB becomes unreachable (server selection fails:
        nothing can have been sent); five more readings, for page 1, wait; MongoDB comes back
        with another writer's page 1 inserted just before the daemon's upsert reaches it.
        With spooled, the five arrive as two batches, 3 and 2, the second once the first
        failed, so the first goes to the on-disk spool (the second may join it or wait in
        memory behind it) and the race meets its replay.
        Returns (daemon, stats, client, db, sent, page 1's _id)."""
        uri, client, db = self.new_database()
        proxy, proxied = self.proxy_for(uri, client)
        metrics_port = bdtest.free_port()
        d = self.new_daemon(proxied, db, max_readings=5,
                            extra={"metrics": {"bind": "127.0.0.1:%d" % metrics_port}}).start()
        sid, meta = "race,sensor=s1", {"measurement": "race", "tags": {"sensor": "s1"}}
        base = hour_aligned_base(5 * NS, 30 * NS)
        sent = [reading(sid, "race", {"sensor": "s1"}, k + 1, base + k * 100 * MS,
                        {"v": 0.5 * k, "seq": k + 1}) for k in range(10)]
        send_tcp(d.addr("tcp"), sent[:5])
        self.wait_stored(client, db, 5, d)
        # Stored is not yet acknowledged: cut off before the daemon has read MongoDB's reply
        # (a slow build), page 0's update was maybe applied, and its retry rightly counts it
        # already applied -- not the race these tests are about.
        self.assertTrue(bdtest.wait_for(lambda: (bdtest.metric(
            metrics_port, "bucketd_readings_flushed_total") or 0) >= 5, DEADLINE, 0.05),
                        "page 0 stored but never acknowledged\n" + bdtest.log_tail(d.log(), 20))

        self.go_unreachable(proxy, d)
        mark = len(d.log())
        send_tcp(d.addr("tcp"), sent[5:8] if spooled else sent[5:])
        self.assertTrue(self.wait_log(d, "a failed attempt", lambda l: "retrying" in l, mark),
                        "no failed write while MongoDB was unreachable\n" + d.log()[mark:])
        if spooled:
            send_tcp(d.addr("tcp"), sent[8:])
            spool_dir = d.config["spool"]["dir"]
            self.assertTrue(bdtest.wait_for(lambda: bdtest.spool_record_bytes(spool_dir) > 0, DEADLINE),
                            "nothing spooled\n" + d.log()[mark:])

        start_ms = base // MS // (HOUR_S * 1000) * (HOUR_S * 1000)
        page1 = "%s|%d|1" % (sid, start_ms // 1000)
        racer = {"sensor_id": sid, "meta": meta, "bucket_start": dt_of_ms(start_ms),
                 "bucket_end": dt_of_ms(start_ms + HOUR_S * 1000 - 1), "page": 1,
                 "count": Int64(0), "readings": [], "w": racing_w}
        proxy.set_fault("race_insert", match_id=page1, fields=racer, count=1)
        self.assertTrue(bdtest.wait_for(lambda: proxy.stats()["race_inserts"] >= 1, DEADLINE),
                        "no upsert of %s reached the proxy: %r\n%s" % (
                            page1, proxy.stats(), d.log()[mark:]))
        return d, client, db, sent, page1

    def test_nothing_sent_then_another_writers_page(self):
        """Variant A: the racing page is another writer's (w: {other: 1}); the daemon's update
        finds it and appends to it.

        On 18e0a24: passes (the racing document matches the update's filter, so no duplicate
        key comes back for the wrongly "maybe applied" update to be mistaken on)."""
        d, client, db, sent, page1 = self.run_nothing_sent_then_race({"other": Int64(1)})
        st = self.settle(client, db, len(sent), d)
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, sent, daemon=d)
        theirs = client[db].buckets.find_one({"_id": page1})
        self.assertEqual(theirs["w"]["other"], 1)
        self.assertEqual(theirs["count"], 5)
        self.assertStat(st, "updates_already_applied", 0, d)
        self.assertStat(st, "readings_flushed", len(sent), d)
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 5), "invariants", d)

    def test_nothing_sent_then_a_writer_id_clash(self):
        """Variant B: the racing page carries this daemon's writer_id with a sequence far
        ahead (a second daemon configured with the same writer_id): a writer conflict, and the
        five readings are not written, so they must not be counted as written.

        On 18e0a24: the attempt that failed at server selection marked the update "maybe
        applied", so the duplicate key of the racing page was taken for its own earlier write:
        updates_already_applied=1, readings_flushed=10 of 10 sent (5 never stored),
        writer_conflicts=0, readings_quarantined=0, no conflict logged."""
        d, client, db, sent, page1 = self.run_nothing_sent_then_race(
            {WRITER: Int64(1 << 62)})
        conflict = self.wait_log(d, "the conflict", lambda l: (
            "another daemon is using writer_id %s" % WRITER) in l, timeout=30)
        st = d.stop()
        self.assertTrue(conflict, "no writer conflict logged; stats %r\n%s" % (
            st, bdtest.log_tail(d.log(), 20)))
        self.assertGreaterEqual(st.get("writer_conflicts", 0), 1, st)
        self.assertEqual(st.get("readings_flushed", 0) + st.get("readings_quarantined", 0),
                         len(sent), st)
        self.assertEqual(st.get("readings_flushed"), 5, st)
        self.assertStat(st, "updates_already_applied", 0, d)
        docs = [doc for doc in self.documents(client, db) if doc["_id"] != page1]
        self.assertExactlyOnce(docs, sent[:5], daemon=d)
        self.assertEqual(client[db].buckets.find_one({"_id": page1})["readings"], [])

    def test_nothing_sent_spooled_then_a_writer_id_clash(self):
        """Variant B through the spool: a batch that never reached MongoDB is written to the
        on-disk spool and replayed when it is back; replaying it meets the page of a second
        daemon with this writer_id. Each spooled update records that no attempt of it can
        have reached MongoDB, so the page's number is a conflict, not this daemon's own
        earlier write.

        Before 88769e8 a replayed update counted every page holding its number as applied.
        Measured on f49a78b: readings_spooled=3, readings_flushed=8 (3 of them never stored),
        updates_already_applied=1; only the batch written from memory was a conflict
        (writer_conflicts=1, readings_quarantined=2)."""
        d, client, db, sent, page1 = self.run_nothing_sent_then_race(
            {WRITER: Int64(1 << 62)}, spooled=True)
        conflict = self.wait_log(d, "the conflict", lambda l: (
            "another daemon is using writer_id %s" % WRITER) in l, timeout=30)
        st = d.stop()
        self.assertTrue(conflict, "no writer conflict logged; stats %r\n%s" % (
            st, bdtest.log_tail(d.log(), 20)))
        self.assertGreater(st.get("readings_spooled", 0), 0, st)
        self.assertGreaterEqual(st.get("writer_conflicts", 0), 1, st)
        self.assertEqual(st.get("readings_flushed"), 5, st)
        self.assertEqual(st.get("readings_quarantined"), 5, st)
        self.assertStat(st, "updates_already_applied", 0, d)
        docs = [doc for doc in self.documents(client, db) if doc["_id"] != page1]
        self.assertExactlyOnce(docs, sent[:5], daemon=d)
        self.assertEqual(client[db].buckets.find_one({"_id": page1})["readings"], [])

    # -- 3. the page cap across a long outage: test_flusher_long_outage.py ---------------------

    # -- 4. long names ----------------------------------------------------------------------

    def test_long_sensor_ids_and_field_keys_stay_apart(self):
        """Two sensor ids of 1,100 bytes that share their first 1,050, one reading each in
        three hours; and one sensor with two field keys of 331 bytes sharing 330.

        On 18e0a24: the _ids of the long sensors were cut to 1,023 bytes, before the bucket
        start and page, so all six updates aimed at one document: stored 2 of 7 readings (one
        long sensor's first, and the field-key sensor's), writer_conflicts=5,
        updates_quarantined=5, readings_quarantined=5. And the field-key sensor's summary held
        one entry, both keys cut to the same 311 bytes, with the value null (the reading kept
        both keys whole)."""
        uri, client, db = self.new_database()
        # limits.max_name (default 1 KiB) raised so that ids of 1,100 bytes are taken.
        d = self.new_daemon(uri, db, extra={"buckets": {"max_late": "4h"},
                                            "limits": {"max_name": "2KiB"}}).start()
        measurement = "m" + "L" * 1049
        ids, sent = [], []
        now = time.time_ns()
        for tail in ("a" * 47, "b" * 47):
            tags = {"k": tail}
            sid = "%s,k=%s" % (measurement, tail)
            self.assertEqual(len(sid), 1100)
            ids.append(sid)
            for h in range(3):
                seq = len(sent) + 1
                sent.append(reading(sid, measurement, tags, seq,
                                    now - h * HOUR_S * NS - 60 * NS, {"v": 1.5 * seq,
                                                                      "seq": seq}))
        self.assertEqual(ids[0][:1050], ids[1][:1050])
        k1, k2 = "F" * 330 + "a", "F" * 330 + "b"
        fk = reading("fk", "fk", {}, 100, now - 30 * NS, {k1: 1.25, k2: -7.5, "seq": 100})
        send_tcp(d.addr("tcp"), sent + [fk])
        st = self.settle(client, db, len(sent) + 1, d)
        docs = self.documents(client, db)
        long_docs = [doc for doc in docs if doc.get("sensor_id") in ids]
        got = sorted((doc["sensor_id"][-47:], doc["bucket_start"], doc["page"], doc["count"])
                     for doc in long_docs)
        want = sorted((r.sensor_id[-47:], dt_of_ms(r.ts_ns // MS // 3600000 * 3600000), 0, 1)
                      for r in sent)
        self.assertEqual(got, want, "documents of the long sensor ids (their last 47 bytes, "
                                    "bucket, page, count)")
        self.assertEqual(len({doc["_id"] for doc in long_docs}), 6)
        self.assertExactlyOnce(docs, sent + [fk], daemon=d)
        # Every invariant but the _id's form (a fix may put a digest in a long id's _id).
        problems = [p for p in bdtest.check_documents(docs, HOUR_S, 3600)
                    if ": _id " not in p]
        self.assertNoProblems(problems, "invariants", d)
        fk_doc = [doc for doc in docs if doc.get("sensor_id") == "fk"]
        self.assertEqual(len(fk_doc), 1)
        summary = fk_doc[0]["summary"]
        for key, value in ((k1, 1.25), (k2, -7.5)):
            self.assertIn(key, summary, sorted(k[-3:] for k in summary))
            self.assertEqual((summary[key]["min"], summary[key]["max"], summary[key]["sum"],
                              summary[key]["count"], summary[key]["avg"]),
                             (value, value, value, 1, value))
        self.assertEqual(fk_doc[0]["readings"][0][k1], 1.25)
        self.assertEqual(fk_doc[0]["readings"][0][k2], -7.5)
        for name in ("updates_quarantined", "writer_conflicts", "readings_lost"):
            self.assertStat(st, name, 0, d)

    # -- 5. a permanent error of one document ------------------------------------------------

    def test_validator_refusal_is_isolated(self):
        """A collection validator refuses every document of sensor "poison": its readings are
        quarantined (counted), everyone else's are stored, also after the refusal.

        On 18e0a24: passes (a writeErrors entry with code 121 quarantines that update alone)."""
        uri, client, db = self.new_database()
        client[db].create_collection("buckets", validator={"sensor_id": {"$ne": "poison"}})
        d = self.new_daemon(uri, db).start()
        base = time.time_ns() - 90 * NS
        normal = send_readings.make_readings(sensors=5, per_sensor=30, start_ns=base,
                                             span_ns=20 * NS, prefix="ok")
        poison = [reading("poison", "poison", {}, 9000 + k, base + k * 10 * MS,
                          {"v": float(k), "seq": 9000 + k}) for k in range(25)]
        send_tcp(d.addr("tcp"), normal + poison)
        self.wait_stored(client, db, len(normal), d)
        refused = self.wait_log(d, "the refusal", lambda l: "poison" in l and "121" in l)
        self.assertTrue(refused, "the refusal of the poison sensor's update is not logged\n" +
                        bdtest.log_tail(d.log(), 40))
        later = send_readings.make_readings(sensors=5, per_sensor=10, start_ns=base + 30 * NS,
                                            span_ns=20 * NS, prefix="ok", seq_base=5000)
        send_tcp(d.addr("tcp"), later)
        self.wait_stored(client, db, len(normal) + len(later), d)
        self.assertTrue(d.alive())
        st = d.stop()
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, normal + later, daemon=d)
        self.assertGreaterEqual(st.get("updates_quarantined", 0), 1, st)
        self.assertStat(st, "readings_quarantined", len(poison), d)
        self.assertStat(st, "readings_flushed", len(normal) + len(later), d)

    # -- 6. transient errors -----------------------------------------------------------------

    def test_shutdown_in_progress_is_retried(self):
        """failCommand: the next three updates of the daemon's collection fail with
        ShutdownInProgress (91), unapplied. Every reading is stored once.

        On 18e0a24: passes."""
        uri, client, db = self.new_database()
        before = self.fail_point(client, {"times": 3}, failCommands=["update"], errorCode=91,
                                 namespace="%s.buckets" % db)["count"]
        d = self.new_daemon(uri, db).start()
        sent = send_readings.make_readings(sensors=5, per_sensor=40,
                                           start_ns=time.time_ns() - 120 * NS, span_ns=60 * NS)
        send_tcp(d.addr("tcp"), sent)
        st = self.settle(client, db, len(sent), d)
        after = client.admin.command("configureFailPoint", "failCommand", mode="off")["count"]
        self.assertEqual(after - before, 3, "the fail point did not fail three updates")
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, sent, daemon=d)
        self.assertStat(st, "readings_flushed", len(sent), d)
        self.assertStat(st, "updates_quarantined", 0, d)
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 3600), "invariants", d)

    def test_write_concern_error_is_already_applied(self):
        """failCommand: the next two updates of the daemon's collection apply and then report
        a write concern error (64). The retry must find them applied, not apply them again.

        On 18e0a24: passes."""
        uri, client, db = self.new_database()
        wce = {"code": 64, "codeName": "WriteConcernFailed",
               "errmsg": "waiting for replication timed out", "errInfo": {"wtimeout": True}}
        before = self.fail_point(client, {"times": 2}, failCommands=["update"],
                                 writeConcernError=wce, namespace="%s.buckets" % db)["count"]
        d = self.new_daemon(uri, db).start()
        sent = send_readings.make_readings(sensors=5, per_sensor=40,
                                           start_ns=time.time_ns() - 120 * NS, span_ns=60 * NS)
        send_tcp(d.addr("tcp"), sent)
        st = self.settle(client, db, len(sent), d)
        after = client.admin.command("configureFailPoint", "failCommand", mode="off")["count"]
        self.assertEqual(after - before, 2, "the fail point did not hit two updates")
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, sent, daemon=d)
        self.assertGreaterEqual(st.get("updates_already_applied", 0), 1, st)
        self.assertStat(st, "readings_flushed", len(sent), d)
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 3600), "invariants", d)

    # -- 7. a sensor evicted while the flusher holds its readings -----------------------------

    def test_sensor_whose_readings_are_held_is_not_evicted(self):
        """limits.sensor_idle 2s, flush.max_delay 10m (the defect does not depend on its value;
        a long one keeps the scenario whatever the machine's speed). Sensor "held" sends one
        reading, which is written at once (its bucket began before the start: its pages are
        read back, then known), then nine more, which wait in the flusher's fill batch for
        max_delay. Sensor "witness" sends 120 readings (their page is written at once too); a
        client sends comment lines meanwhile (every batch of lines lets the daemon take back
        idle queue segments), until the witness is evicted: "held", silent longer, is as idle.
        Its eleventh reading follows, in the same bucket, then SIGTERM. Every reading is stored
        once, on one page of "held".

        On 324dd31: "held" was evicted with its nine readings still in the fill batch; the
        eleventh made a new sensor, which read the bucket's page 0 back (one reading) and put
        its reading there; at the stop both deltas of page 0 went in one bulk under one
        sequence number, the second drew E11000, its read-back found our own number and it was
        quarantined as "another daemon is using writer_id": 131 sent, 130 stored,
        writer_conflicts=1 readings_quarantined=1."""
        uri, client, db = self.new_database()
        mport = bdtest.free_port()
        d = self.new_daemon(uri, db, extra={
            "limits": {"sensor_idle": "2s"},
            "flush": {"max_delay": "10m"},
            "metrics": {"bind": "127.0.0.1:%d" % mport}}).start()
        addr = d.addr("tcp")
        base = hour_aligned_base(200 * MS, 30 * NS)
        held = [reading("held,sensor=h1", "held", {"sensor": "h1"}, k + 1, base + k * MS,
                        {"v": 0.5 * k, "seq": k + 1}) for k in range(11)]
        witness = [reading("witness,sensor=w1", "witness", {"sensor": "w1"}, k + 1,
                           base + 50 * MS + k * MS, {"v": float(k), "seq": k + 1})
                   for k in range(120)]

        send_tcp(addr, held[:1])
        self.wait_stored(client, db, 1, d)
        send_tcp(addr, held[1:10])
        self.assertTrue(bdtest.wait_for(
            lambda: bdtest.metric(mport, "bucketd_pending_readings") == 9, DEADLINE),
            "the nine readings were not drained and held\n" + bdtest.log_tail(d.log(), 20))
        send_tcp(addr, witness)
        self.wait_stored(client, db, 1 + len(witness), d)

        tick = socket.create_connection(addr)
        self.addCleanup(tick.close)

        def witness_evicted():
            tick.sendall(b"# tick\n")
            return (bdtest.metric(mport, "bucketd_sensors_evicted_total") or 0) >= 1
        self.assertTrue(bdtest.wait_for(witness_evicted, DEADLINE, 0.2),
                        "the witness was never evicted: %s sensors tracked\n%s" % (
                            bdtest.metric(mport, "bucketd_sensors"),
                            bdtest.log_tail(d.log(), 20)))

        sent = held + witness
        send_tcp(addr, held[10:])
        self.assertTrue(bdtest.wait_for(
            lambda: bdtest.metric(mport, "bucketd_readings_accepted_total") == len(sent),
            DEADLINE), "the tenth reading was not accepted\n" + bdtest.log_tail(d.log(), 20))
        st = d.stop()
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, sent, daemon=d)
        self.assertEqual([(doc["page"], doc["count"]) for doc in docs
                          if doc["sensor_id"] == "held,sensor=h1"], [(0, len(held))])
        for name in ("writer_conflicts", "readings_quarantined", "readings_lost"):
            self.assertStat(st, name, 0, d)
        self.assertStat(st, "readings_flushed", len(sent), d)
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 3600), "invariants", d)


class SplitBulkCase(RegressionCase):
    """A bulk libmongoc splits into several commands, the second of which fails whole after
    the first answered a writeErrors entry (the helpers; the tests are below). libmongoc splits
    a bulk past the server's maxWriteBatchSize updates or maxMessageSizeBytes (48 MB): with
    the test server at maxWriteBatchSize 2, a bulk of four small updates; with a server that
    takes more updates a command than flush.max_updates sends (a real MongoDB takes 100,000,
    the most flush.max_updates allows), a bulk of some 52 MB."""

    def split_geometry(self, client):
        """What to send for a bulk that libmongoc sends as two commands or more, the foreign
        page's update first: a dict of first (the foreign page's sensor's readings), others
        (the other sensors'), cfg (daemon settings), by_bytes, batch and max_msg (the
        server's limits)."""
        hello = client.admin.command("hello")
        g = {"batch": hello["maxWriteBatchSize"], "max_msg": hello["maxMessageSizeBytes"]}
        base = hour_aligned_base(60 * NS, 120 * NS)
        # The foreign page's sensor is sent first, and its id sorts first ("room=a00" before
        # make_readings' "room=r.."): a first start writes a batch in the order of its page
        # look-up, by bucket and sensor id, later batches in the order sensors were drained.
        tags = {"room": "a00", "sensor": "s000"}
        g["first"] = [reading("split,room=a00,sensor=s000", "split", tags, k + 1,
                              base + k * 10 * MS, {"v": float(k), "seq": k + 1})
                      for k in range(5)]
        # flush.max_updates (1000 by default) must take more updates than a command does.
        g["by_bytes"] = 2 * g["batch"] > 1000
        if not g["by_bytes"]:
            g["others"] = send_readings.make_readings(
                sensors=2 * g["batch"] - 1, per_sensor=5, start_ns=base, span_ns=50 * NS,
                prefix="split", seq_base=100, sensor_base=1)
            g["cfg"] = {}
            return g
        # Seven sensors of about 7.5 MB each (under buckets.max_bytes 8 MiB: one page each):
        # a bulk of some 52 MB, over max_msg.
        names = ["f%02d_" % i + "n" * 196 for i in range(10)]
        g["others"] = []
        for si in range(1, 8):
            for k in range(3500):
                seq = si * 100000 + k
                fields = {"seq": seq}
                fields.update((n, float(i) + k / 1000.0) for i, n in enumerate(names))
                g["others"].append(reading("wide,sensor=w%d" % si, "wide", {"sensor": "w%d" % si},
                                           seq, base + k * 10 * MS, fields))
        g["cfg"] = {"buckets": {"max_bytes": "8MiB"}, "limits": {"memory": "512MiB"}}
        return g

    def run_split_bulk(self):
        """The first update's page is held by a foreign document with its _id (another
        sensor's): its upsert answers E11000 in the first command, which applies the others;
        the second command fails whole with InterruptedAtShutdown (11600, failCommand {skip:
        1}), nothing of it applied. libmongoc stops there and returns the E11000 as the bulk's
        error; its reply counts the first command's updates only. Every reading but the
        foreign page's sensor's (quarantined after its duplicate-key answers) must be stored
        once, and readings_flushed must be what is stored.

        The whole batch is written by the stop (flush.interval 1h: nothing is written before
        it), so every update goes in one bulk, the foreign page's first (see split_geometry);
        the bulk's first failure, a duplicate key, shows it was.

        Against a real replica set the server labels 11600 RetryableWriteError, which bucketd
        took as ambiguous already; a standalone, like the test server, does not."""
        uri, client, db = self.new_database()
        g = self.split_geometry(client)
        first, others = g["first"], g["others"]
        sent = first + others
        try:
            self.fail_point(client, {"skip": 1}, failCommands=["update"], errorCode=11600,
                            namespace="%s.buckets" % db)
        except pymongo.errors.OperationFailure as e:
            self.skipTest("the server refuses configureFailPoint (%s): start mongod with "
                          "--setParameter enableTestCommands=1" % e)
        start_ms = first[0].ts_ns // MS // (HOUR_S * 1000) * (HOUR_S * 1000)
        foreign_id = "%s|%d|0" % (first[0].sensor_id, start_ms // 1000)
        client[db].buckets.insert_one({"_id": foreign_id, "sensor_id": "foreign",
                                       "bucket_start": dt_of_ms(start_ms), "page": 0,
                                       "count": Int64(0), "readings": []})
        mport = bdtest.free_port()
        # The stop writes the whole batch and retries the foreign page's update until it is
        # quarantined: flush.stop_timeout leaves it time for that on a loaded machine (the
        # tests run in parallel), or the stop would spool what it had not finished and the
        # quarantine counted below would not happen. How long the stop takes is not the
        # subject; it ends as soon as the writes are done.
        extra = bdtest.deep_merge({"metrics": {"bind": "127.0.0.1:%d" % mport},
                                   "flush": {"stop_timeout": "%ds" % (DEADLINE - 15)}},
                                  g["cfg"])
        d = self.new_daemon(uri, db, flush_interval="1h", extra=extra).start()
        send_tcp(d.addr("tcp"), sent)
        self.assertTrue(bdtest.wait_for(
            lambda: bdtest.metric(mport, "bucketd_readings_accepted_total") == len(sent),
            DEADLINE), "not every reading accepted\n" + bdtest.log_tail(d.log(), 20))

        mark = len(d.log())
        d.proc.send_signal(signal.SIGTERM)
        failed = self.wait_log(d, "the failed bulk", lambda l: "MongoDB write failed" in l, mark)
        fired = client.admin.command("configureFailPoint", "failCommand", mode="off")["count"]
        self.assertTrue(failed, "no failed write at the stop\n" + d.log()[mark:])
        self.assertIn("E11000", failed, "the first command did not answer the foreign page's "
                      "duplicate key: the bulk was not split as intended\n" + d.log()[mark:])
        self.assertGreaterEqual(fired, 1, "the fail point failed no command")
        self.assertTrue(bdtest.wait_for(lambda: not d.alive(), DEADLINE),
                        "the stop did not end\n" + bdtest.log_tail(d.log(), 20))
        st = d.stop()

        ours = [doc for doc in self.documents(client, db) if doc["_id"] != foreign_id]
        stored = sum(len(doc.get("readings") or []) for doc in ours)
        # What was sent makes a bulk libmongoc splits: more updates than a command takes, or
        # readings (each a document in its update) of more bytes than a message holds.
        if g["by_bytes"]:
            self.assertGreater(sum(len(bson.encode(r.fields)) for r in sent), g["max_msg"])
        else:
            self.assertGreater(len({r.sensor_id for r in sent}), g["batch"])
        self.assertEqual(client[db].buckets.find_one({"_id": foreign_id})["readings"], [])
        self.assertStat(st, "readings_accepted", len(sent), d)
        self.assertEqual(st.get("readings_flushed"), stored,
                         "readings_flushed is not what is stored; stats %r\n%s" % (
                             st, bdtest.log_tail(d.log(), 20)))
        self.assertExactlyOnce(ours, others, daemon=d)
        self.assertStat(st, "readings_flushed", len(others), d)
        self.assertStat(st, "readings_quarantined", len(first), d)
        self.assertStat(st, "readings_lost", 0, d)
        self.assertNoProblems(bdtest.check_documents(ours, HOUR_S, 3600, strict_pages=False),
                              "invariants", d)



class SplitBulkByCount(SplitBulkCase):
    mongo_options = {"max_write_batch": 2}

    def test_split_bulk_whose_second_command_fails_is_not_counted_stored(self):
        """Four sensors of five readings, one bulk of four updates: two commands of two (with
        an external MongoDB: as SplitBulkByBytes).

        On 0bed50e the second command's updates were taken as applied: readings_accepted=20
        readings_flushed=15 readings_quarantined=5 readings_lost=0, 5 readings stored (10
        counted flushed and never stored)."""
        self.run_split_bulk()


class SplitBulkByBytes(SplitBulkCase):
    def test_split_bulk_whose_second_command_fails_is_not_counted_stored(self):
        """The foreign page's sensor's five readings and seven sensors of 3,500 readings of
        about 2 KB (ten fields with 200-byte names), one page each: a bulk of eight updates,
        some 52 MB, that libmongoc sends as two commands (the foreign page's update and six
        others, then the last).

        On 0bed50e the second command's updates were taken as applied:
        readings_accepted=24505 readings_flushed=24500 readings_quarantined=5, 21,000 readings
        stored (3,500 counted flushed and never stored)."""
        self.run_split_bulk()


if __name__ == "__main__":
    unittest.main(verbosity=2)
