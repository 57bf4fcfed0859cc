#!/usr/bin/python3
"""The document model end to end (DESIGN.md §3; bucketd-schema(7) "DOCUMENT SCHEMA", "Sharded clusters and
replica sets", "Writer identity", "Field and tag names"), against the test server's strict modes.

- Sharded collections: with the server sharded on {sensor_id: "hashed"} or {sensor_id: 1,
  bucket_start: 1} (an upsert without an equality on every shard-key field fails with 61, as
  mongos 5.x-6.x answers), every reading is stored exactly once through an ambiguous failure
  (a reply lost after the write was applied).
- A racing second writer on a fresh page after an ambiguous failure: the duplicate-key answer
  to the retry is another writer's page, not this writer's earlier attempt; and two daemons
  writing one page at the same time while one of them loses replies.
- Names with '.' and '$' in tag keys, tag values and the measurement (test_names.py covers
  field names and tag keys with '.'; here a leading '$' in a tag key, and the rest of the
  series key).
- The byte cap: readings of 32 fields with 60-character names fill pages that all stay below
  buckets.max_bytes.
- The write cost with holding (flush.max_delay), time-compressed: bytes rewritten / bytes
  stored, and how soon readings become visible.
- Equal timestamps after late data with an unstable $sortArray (bucketd-schema(7): readings stay sorted by
  ts, "stable for equal times").
- A shard key bucketd cannot target (61): retried, logged once, nothing quarantined; at the stop
  what was not written is spooled.

Expectations come from what the test sent; waits are on stored readings, log lines, the proxy's
or the server's counters, never on the clock alone. With BUCKETD_TEST_MONGODB_URI the tests run
against that MongoDB; those that need a switch or a counter of the test server are skipped
(each says why), and the fail point of the racing-writer test needs a server started with
--setParameter enableTestCommands=1.

Run: /usr/bin/python3 tests/e2e/test_document_model.py
Environment (besides bdtest.py's): BUCKETD_INSPECT_BIN (default <repo>/build/bucketd-inspect).
"""

import collections
import datetime
import glob
import os
import socket
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for fault_proxy

import bdtest  # noqa: E402
import send_readings  # noqa: E402  (tools/send_readings.py, on bdtest's path)

import bson  # noqa: E402
from bson.int64 import Int64  # noqa: E402

INSPECT = bdtest.INSPECT
NS = 1_000_000_000
MS = 1_000_000
HOUR_S = 3600
DEADLINE = 120          # seconds to wait for an event that should come in a few
MAX_BSON = 16 * 1024 * 1024
WRITER = "docmodel"     # writer_id of the daemons unless a test names its own


# ---------------------------------------------------------------------------------------------
# Readings and checks
# ---------------------------------------------------------------------------------------------

def influx_escape_key(s):
    """A tag key, tag value or field key as line protocol writes it."""
    return s.replace("\\", "\\\\").replace(",", "\\,").replace("=", "\\=").replace(" ", "\\ ")


def influx_escape_measurement(s):
    return s.replace("\\", "\\\\").replace(",", "\\,").replace(" ", "\\ ")


def reading(measurement, tags, seq, ts_ns, fields, seq_field="seq"):
    """A send_readings.Reading for an influx line with the given fields (name -> value; ints
    are sent as i-integers, floats as floats). fields must include seq_field = seq."""
    assert fields[seq_field] == seq
    head = influx_escape_measurement(measurement) + "".join(
        ",%s=%s" % (influx_escape_key(k), influx_escape_key(v)) for k, v in sorted(tags.items()))
    sensor_id = measurement + "".join(",%s=%s" % (k, v) for k, v in sorted(tags.items()))
    parts = []
    for name, value in fields.items():
        parts.append("%s=%di" % (influx_escape_key(name), value) if isinstance(value, int) else
                     "%s=%r" % (influx_escape_key(name), value))
    line = "%s %s %d" % (head, ",".join(parts), ts_ns)
    return send_readings.Reading(0, sensor_id, measurement, dict(tags), seq, ts_ns,
                                 dict(fields), line.encode(), "influx")


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


def seq_counts(docs, seq_field="seq"):
    """Counter of (sensor_id, sequence number) over every stored reading."""
    out = collections.Counter()
    for doc in docs:
        for r in doc.get("readings") or []:
            out[(doc.get("sensor_id"), r.get(seq_field))] += 1
    return out


def rewrite_stats(client, db, reset=False):
    """The test server's {bucketdTestStats: "buckets"}: bytes of the documents updates wrote,
    updates applied, bytes stored, documents stored."""
    reply = client[db].command("bucketdTestStats", "buckets", reset=reset)
    return {k: int(reply[k]) for k in ("docBytesWritten", "updatesApplied", "storedBytes",
                                       "count")}


# ---------------------------------------------------------------------------------------------
# Base
# ---------------------------------------------------------------------------------------------

class DocumentModelCase(bdtest.E2ECase):
    db_prefix = "e2e_docmodel"

    @classmethod
    def setUpClass(cls):
        if not os.access(INSPECT, os.X_OK):
            raise AssertionError("%s not found (set BUCKETD_INSPECT_BIN)" % INSPECT)

    def require_test_server(self, why):
        """Skip unless the class's test server (not an external MongoDB) serves the test."""
        self.mongo_uri()
        if not self.mongo.owned:
            self.skipTest(why)

    def new_daemon(self, uri, db, name="d", writer_id=WRITER, max_readings=3600,
                   flush_interval="200ms", extra=None):
        cfg = {"writer_id": writer_id,
               "flush": {"retry_initial": "50ms", "retry_max": "1s"}}
        cfg = bdtest.deep_merge(cfg, extra or {})
        return self.daemon(uri, db, name=name, max_readings=max_readings,
                           flush_interval=flush_interval, extra=cfg,
                           listeners=[{"name": "tcp", "proto": "tcp", "format": "influx"}])

    def proxy_for(self, uri, client, **uri_opts):
        """A fault proxy in front of the server, and the URI the daemon uses through it."""
        return bdtest.start_fault_proxy(self, uri, client, **uri_opts)

    def wait_proxy(self, proxy, what, cond, d):
        self.assertTrue(bdtest.wait_for(lambda: cond(proxy.stats()), DEADLINE),
                        "%s: proxy %r\n%s" % (what, proxy.stats(), bdtest.log_tail(d.log(), 30)))

    def wait_log(self, d, pred, since=0, timeout=DEADLINE):
        """Wait until a log line after offset `since` satisfies pred; returns it or None."""
        def find():
            for line in d.log()[since:].splitlines():
                if pred(line):
                    return line
            return None
        return bdtest.wait_for(find, timeout, 0.1)

    def settle(self, client, db, n, daemons, timeout=DEADLINE):
        """Wait (up to timeout) until n readings are stored, then stop the daemons; returns
        their stats. The count is asserted after the stops, so a failure shows the counters."""
        stored = bdtest.wait_stored(client, db, n, timeout)
        stats = [d.stop() for d in daemons]
        self.assertEqual(stored, n, "readings stored (waited up to %ds); stats %r\n%s" % (
            timeout, stats, "\n".join(bdtest.log_tail(d.log(), 20) for d in daemons)))
        return stats

    def assertExactlyOnce(self, docs, sent, seq_field="seq", daemons=()):
        """Every reading sent stored once, nothing else stored."""
        want = collections.Counter((r.sensor_id, r.seq) for r in sent)
        self.assertEqual(max(want.values()), 1, "the sent set repeats a (sensor, seq)")
        got = seq_counts(docs, seq_field)
        twice = sorted((k for k, n in got.items() if n > 1), key=repr)
        extra = sorted((k for k in got if k not in want), key=repr)
        missing = sorted((k for k in want if k not in got), key=repr)
        logs = "".join("\n--- log %s ---\n%s" % (d.log_path, bdtest.log_tail(d.log(), 30))
                       for d in daemons)
        self.assertEqual(
            (len(missing), len(twice), len(extra)), (0, 0, 0),
            "of %d readings sent: %d missing (e.g. %s), %d stored twice (e.g. %s), %d never "
            "sent (e.g. %s)%s" % (len(want), len(missing), missing[:5], len(twice), twice[:3],
                                  len(extra), extra[:3], logs))

    def assertVerifyClean(self, uri, db, max_readings):
        rc, out = bdtest.inspect_verify(uri, db, max_readings)
        self.assertEqual(rc, 0, "bucketd-inspect verify:\n%s" % out)


# ---------------------------------------------------------------------------------------------
# 1. Sharded collections: exactly once through an ambiguous failure
# ---------------------------------------------------------------------------------------------

SHARD_CAP = 25  # readings per page: small, so buckets have several pages


class ShardedCase(DocumentModelCase):
    """The server refuses an upsert without an equality on every field of `shard_key` (61)."""

    shard_key = None       # keyspec of the class's server
    probe_filter = None    # an upsert filter the key's mongos could not target

    def check_server_is_sharded(self, client, db):
        """On the test server, an upsert that does not pin the shard key is refused (so the
        daemon's were targeted); an external MongoDB is whatever it is."""
        if not self.mongo.owned:
            return
        with self.assertRaises(Exception) as cm:
            client[db]["probe"].update_one(self.probe_filter, {"$set": {"x": 1}}, upsert=True)
        self.assertEqual(getattr(cm.exception, "code", None), 61, cm.exception)

    def run_sharded_exactly_once(self):
        """Readings of six sensors over three hours (several buckets, several pages each), the
        first half written, then the replies of the next two bulk writes lost after the server
        applied them, then the rest: every reading stored once, nothing quarantined, no 61."""
        uri, client, db = self.new_database()
        self.check_server_is_sharded(client, db)
        proxy, proxied = self.proxy_for(uri, client)
        d = self.new_daemon(proxied, db, max_readings=SHARD_CAP).start()
        sent = sorted(send_readings.make_readings(sensors=6, per_sensor=120, prefix="shard",
                                                  seed=7),
                      key=lambda r: r.ts_ns)
        first, second = sent[:len(sent) // 2], sent[len(sent) // 2:]
        send_tcp(d.addr("tcp"), first)
        self.assertEqual(bdtest.wait_stored(client, db, len(first), DEADLINE), len(first),
                         "first half stored\n" + bdtest.log_tail(d.log(), 30))
        writes_before = proxy.stats()["writes_forwarded"]
        self.assertGreater(writes_before, 0)

        proxy.set_fault("drop_reply", writes_only=True, count=2)
        send_tcp(d.addr("tcp"), second)
        self.wait_proxy(proxy, "two replies dropped", lambda ps: ps["replies_dropped"] >= 2, d)
        proxy.set_fault("pass")
        (st,) = self.settle(client, db, len(sent), [d])

        self.assertStat(st, "readings_flushed", len(sent), d)
        for name in ("updates_quarantined", "readings_quarantined", "writer_conflicts",
                     "readings_lost"):
            self.assertStat(st, name, 0, d)
        self.assertGreater(st["bulk_retries"], 0, st)
        self.assertGreater(st["updates_already_applied"], 0,
                           "a retry found the updates of a lost reply applied: %r" % st)
        shard_errors = [l for l in d.log_lines() if "code 61" in l or "sharded on a key" in l]
        self.assertEqual(shard_errors, [], "the shard key could not be targeted")

        docs = self.documents(client, db)
        self.assertNoProblems(bdtest.check_readings(docs, sent, HOUR_S), "readings", d)
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, SHARD_CAP), "invariants", d)
        self.assertGreater(len({(doc["sensor_id"], doc["bucket_start"]) for doc in docs}), 6,
                           "several buckets per sensor")
        self.assertGreater(max(doc["page"] for doc in docs), 0, "several pages per bucket")
        self.assertVerifyClean(uri, db, SHARD_CAP)


class ShardedHashed(ShardedCase):
    mongo_options = {"sharded": "sensor_id:hashed"}
    probe_filter = {"_id": "probe"}

    def test_hashed_sensor_id_exactly_once_through_lost_replies(self):
        self.run_sharded_exactly_once()


class ShardedRange(ShardedCase):
    mongo_options = {"sharded": "sensor_id:1,bucket_start:1"}
    probe_filter = {"_id": "probe", "sensor_id": "probe"}

    def test_sensor_id_bucket_start_exactly_once_through_lost_replies(self):
        self.run_sharded_exactly_once()


# ---------------------------------------------------------------------------------------------
# 2. A second writer on the same fresh page, after an ambiguous failure
# ---------------------------------------------------------------------------------------------

class RacingWriter(DocumentModelCase):

    def test_other_writers_insert_answers_the_retry_with_duplicate_key(self):
        """Daemon A (writer gw-a, max_readings 3) fills page 0 of a bucket; then it writes the
        first readings of page 1 while the proxy holds every message: its write times out, an
        ambiguous failure, and is never applied. Another writer (gw-b) inserts page 1 in the
        window of A's retry (race_insert: its insert lands between the retry's match and its
        insert, so the retry gets duplicate key, 11000, as from a concurrent upsert on a real
        server); by the time A reads the page back it is gw-b's whole page, holding gw-b's
        reading and no w.gw-a. A must not take the 11000 for its own earlier attempt (that
        would lose its readings): it sends the update again, which appends to gw-b's page.
        Every reading of both writers is stored once.

        Page 1, not page 0: a bucket this daemon has not written yet is looked up (a find)
        before its first update, which the held messages would hold too. The server holds A's
        read-back for 2.5 s (failCommand blockConnection on find, for appName bucketd) so that
        the test completes gw-b's page before A reads it; should that take longer, A's next
        attempt meets the same duplicate key and reads again."""
        uri, client, db = self.new_database()
        # The daemon's socket timeout: how soon a held write fails (longer than the held find).
        proxy, proxied = self.proxy_for(uri, client, socketTimeoutMS=4000)
        d = self.new_daemon(proxied, db, writer_id="gw-a", max_readings=3).start()
        base = hour_aligned_base(10 * NS, 120 * NS)
        start_ms = base // MS // (HOUR_S * 1000) * (HOUR_S * 1000)
        sid, tags = "race,site=roof", {"site": "roof"}
        page0 = [reading("race", tags, 1 + k, base + k * NS, {"v": 0.5 + k, "seq": 1 + k})
                 for k in range(3)]
        send_tcp(d.addr("tcp"), page0)
        self.assertEqual(bdtest.wait_stored(client, db, 3, DEADLINE), 3, d.log())

        mine = [reading("race", tags, 10 + k, base + (4 + k) * NS, {"v": 1.0 + k, "seq": 10 + k})
                for k in range(3)]
        theirs = reading("race", tags, 100, base + 3500 * MS, {"v": -2.5, "seq": 100})
        page1 = "%s|%d|1" % (sid, start_ms // 1000)

        # A's first write of page 1: held by the proxy until A gives up on it.
        mark = len(d.log())
        proxy.set_fault("stall")
        send_tcp(d.addr("tcp"), mine)
        failed = self.wait_log(d, lambda l: "MongoDB write failed" in l, mark)
        self.assertTrue(failed, "A's held write did not fail\n" + d.log()[mark:])
        sys.stderr.write("\n    %s\n" % failed)

        # The server holds A's next find: the read-back of the page.
        self.addCleanup(lambda: client.admin.command("configureFailPoint", "failCommand",
                                                    mode="off"))
        client.admin.command("configureFailPoint", "failCommand", mode={"times": 1},
                             data={"failCommands": ["find"], "appName": "bucketd",
                                   "blockConnection": True, "blockTimeMS": 2500})
        finds_before = proxy.stats()["commands"].get("find", 0)
        # gw-b's insert, in the window of the next upsert of the page (the held one or A's
        # retry, whichever comes first): a page that does not match A's filter yet.
        proxy.set_fault("race_insert", match_id=page1, fields={"w": {"gw-b": Int64(1)}},
                        count=1)
        self.wait_proxy(proxy, "the racing insert", lambda ps: ps["race_inserts"] >= 1, d)
        self.wait_proxy(proxy, "A's read-back of the page",
                        lambda ps: ps["commands"].get("find", 0) > finds_before, d)
        # gw-b's page as its own upsert made it.
        done = client[db]["buckets"].update_one({"_id": page1}, {"$set": {
            "sensor_id": sid, "meta": {"measurement": "race", "tags": tags},
            "bucket_start": dt_of_ms(start_ms),
            "bucket_end": dt_of_ms(start_ms + HOUR_S * 1000 - 1),
            "page": 1, "count": Int64(1),
            "readings": [{"ts": dt_of_ms(theirs.ts_ms), "v": -2.5, "seq": Int64(100)}],
            "summary": {"v": {"min": -2.5, "max": -2.5, "sum": -2.5, "count": Int64(1),
                              "avg": -2.5},
                        "seq": {"min": Int64(100), "max": Int64(100), "sum": 100.0,
                                "count": Int64(1), "avg": 100.0}}}})
        self.assertEqual(done.matched_count, 1)

        (st,) = self.settle(client, db, len(page0) + len(mine) + 1, [d])
        entered = client.admin.command("configureFailPoint", "failCommand", mode="off")["count"]
        self.assertGreaterEqual(entered, 1, "A never read the page back")
        # The bucket's look-up before page 0, and the read-back after the duplicate key.
        self.assertGreaterEqual(st["page_lookups"], 2, st)
        self.assertStat(st, "updates_already_applied", 0, d)
        self.assertStat(st, "readings_flushed", len(page0) + len(mine), d)
        for name in ("updates_quarantined", "readings_quarantined", "writer_conflicts",
                     "readings_lost"):
            self.assertStat(st, name, 0, d)
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, page0 + [theirs] + mine, daemons=(d,))
        page = client[db]["buckets"].find_one({"_id": page1})
        self.assertEqual([r["seq"] for r in page["readings"]], [100, 10, 11, 12])
        self.assertEqual(sorted(page["w"]), ["gw-a", "gw-b"])
        # Two writers: up to twice the cap on a page (bucketd-schema(7) "DELIVERY GUARANTEES", several daemons).
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 6, strict_pages=False),
                              "invariants", d)
        self.assertVerifyClean(uri, db, 6)

    def test_two_daemons_on_one_page_while_one_loses_replies(self):
        """Daemons gw-a (through the proxy) and gw-b (direct) write the same sensor's bucket at
        the same time, from its first reading on; the replies of two of gw-a's bulk writes are
        lost after the server applied them. Every reading of both is stored once, on pages
        that carry both writers' sequence numbers."""
        uri, client, db = self.new_database()
        proxy, proxied = self.proxy_for(uri, client)
        # Each daemon keeps its own page cap (bucketd-schema(7) "DELIVERY GUARANTEES", several daemons): room for both.
        da = self.new_daemon(proxied, db, name="a", writer_id="gw-a", max_readings=1000).start()
        dbb = self.new_daemon(uri, db, name="b", writer_id="gw-b", max_readings=1000).start()
        base = hour_aligned_base(60 * NS, 180 * NS)
        tags = {"site": "shared"}
        rounds, per_round = 8, 25
        sent_a, sent_b = [], []
        for rnd in range(rounds):
            if rnd == 3:
                proxy.set_fault("drop_reply", writes_only=True, count=2)
            batch_a, batch_b = [], []
            for k in range(per_round):
                i = rnd * per_round + k
                batch_a.append(reading("two", tags, 1 + i, base + (2 * i) * 10 * MS,
                                       {"v": 0.25 * i, "seq": 1 + i}))
                batch_b.append(reading("two", tags, 100001 + i, base + (2 * i + 1) * 10 * MS,
                                       {"v": -0.25 * i, "seq": 100001 + i}))
            senders = [threading.Thread(target=send_tcp, args=(dd.addr("tcp"), b))
                       for dd, b in ((da, batch_a), (dbb, batch_b))]
            for t in senders:
                t.start()
            for t in senders:
                t.join()
            sent_a += batch_a
            sent_b += batch_b
            if rnd == 3:
                self.wait_proxy(proxy, "two replies dropped",
                                lambda ps: ps["replies_dropped"] >= 2, da)
                proxy.set_fault("pass")
            # Both rounds stored before the next: both daemons write the page each round.
            n = len(sent_a) + len(sent_b)
            self.assertEqual(bdtest.wait_stored(client, db, n, DEADLINE), n,
                             "round %d stored\n%s\n%s" % (rnd, bdtest.log_tail(da.log(), 20),
                                                          bdtest.log_tail(dbb.log(), 20)))
        st_a, st_b = self.settle(client, db, len(sent_a) + len(sent_b), [da, dbb])
        self.assertStat(st_a, "readings_flushed", len(sent_a), da)
        self.assertStat(st_b, "readings_flushed", len(sent_b), dbb)
        self.assertGreater(st_a["updates_already_applied"], 0, st_a)
        for st, dd in ((st_a, da), (st_b, dbb)):
            for name in ("updates_quarantined", "writer_conflicts", "readings_lost"):
                self.assertStat(st, name, 0, dd)
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, sent_a + sent_b, daemons=(da, dbb))
        self.assertTrue(all(sorted(doc["w"]) == ["gw-a", "gw-b"] for doc in docs),
                        [(doc["_id"], doc["w"]) for doc in docs])
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 2000, strict_pages=False),
                              "invariants", da)
        self.assertVerifyClean(uri, db, 2000)


# ---------------------------------------------------------------------------------------------
# 3. '$' and '.' in the rest of the series key
# ---------------------------------------------------------------------------------------------

class SeriesKeyNames(DocumentModelCase):

    def test_dollar_and_dot_in_tag_keys_tag_values_and_measurement(self):
        """test_names.py covers field names ('.', a leading '$', ts, '%') and tag keys with
        '.'. A tag key with a leading '$' is escaped as a field name is (%24); tag values and
        the measurement are stored as sent, also when they start with '$' or hold '.' (the
        update carries them as $literal, so the server never reads them as field paths)."""
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db).start()
        base = hour_aligned_base(10 * NS, 120 * NS)
        tags = {"$env": "$prod", "site": "$root.a", "k.x": "v.$w"}
        sent = [reading("$m.x", tags, 1 + k, base + k * NS, {"v": 1.5 + k, "seq": 1 + k,
                                                             "$f": 2.0 * k})
                for k in range(5)]
        send_tcp(d.addr("tcp"), sent)
        (st,) = self.settle(client, db, len(sent), [d])
        self.assertStat(st, "readings_flushed", len(sent), d)
        self.assertStat(st, "drop_bad_name", 0, d)
        docs = self.documents(client, db)
        self.assertEqual(len(docs), 1, docs)
        doc = docs[0]
        self.assertEqual(doc["sensor_id"], "$m.x,$env=$prod,k.x=v.$w,site=$root.a")
        self.assertEqual(doc["meta"], {"measurement": "$m.x",
                                       "tags": {"%24env": "$prod", "k%2Ex": "v.$w",
                                                "site": "$root.a"}})
        self.assertEqual([(r["seq"], r["v"], r["%24f"]) for r in doc["readings"]],
                         [(r.seq, r.fields["v"], r.fields["$f"]) for r in sent])
        self.assertEqual(sorted(doc["summary"]), ["%24f", "seq", "v"])
        self.assertEqual(client[db]["buckets"].count_documents({"meta.tags.%24env": "$prod"}), 1)
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 3600), "invariants", d)
        self.assertVerifyClean(uri, db, 3600)


# ---------------------------------------------------------------------------------------------
# 4. The byte cap
# ---------------------------------------------------------------------------------------------

class ByteCap(DocumentModelCase):

    MAX_BYTES = 128 * 1024

    def test_32_fields_with_long_names_stay_below_max_bytes(self):
        """One sensor sends 600 readings of 32 fields with 60-character names (about 2.3 KB of
        BSON each), in 12 rounds that are each stored before the next, so pages grow over
        several updates: ~55 readings fill buckets.max_bytes (128KiB, set explicitly) long
        before max_readings (1000). Every stored page is below max_bytes (and so far below
        16 MiB), pages are numbered 0..k in time order, and every reading is stored once."""
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db, max_readings=1000,
                            extra={"buckets": {"max_bytes": "128KiB"}}).start()
        names = ["f%02d_" % i + "long_field_name_" * 4 for i in range(32)]
        names = [n[:60] for n in names]
        self.assertEqual({len(n) for n in names}, {60})
        self.assertEqual(len(set(names)), 32)
        rounds, per_round = 12, 50
        base = hour_aligned_base(rounds * per_round * NS, (rounds * per_round + 120) * NS)
        sent = []
        for rnd in range(rounds):
            batch = []
            for k in range(per_round):
                i = rnd * per_round + k
                fields = {names[0]: 1 + i}
                fields.update((n, j + i / 1000.0) for j, n in enumerate(names[1:], 1))
                batch.append(reading("wide", {"sensor": "w1"}, 1 + i, base + i * NS, fields,
                                     seq_field=names[0]))
            send_tcp(d.addr("tcp"), batch)
            sent += batch
            self.assertEqual(bdtest.wait_stored(client, db, len(sent), DEADLINE), len(sent),
                             "round %d stored\n%s" % (rnd, bdtest.log_tail(d.log(), 20)))
        (st,) = self.settle(client, db, len(sent), [d])
        for name in ("updates_quarantined", "readings_lost"):
            self.assertStat(st, name, 0, d)
        self.assertStat(st, "readings_flushed", len(sent), d)

        docs = sorted(self.documents(client, db), key=lambda doc: doc["page"])
        sizes = [len(bson.encode(doc)) for doc in docs]
        sys.stderr.write("\n    %d pages, BSON sizes %d..%d bytes, readings per page %s\n" % (
            len(docs), min(sizes), max(sizes), [doc["count"] for doc in docs]))
        self.assertGreater(len(docs), 5, "600 readings of ~2.3 KB fill several pages")
        for doc, size in zip(docs, sizes):
            self.assertLessEqual(size, self.MAX_BYTES, "%s: %d bytes" % (doc["_id"], size))
            self.assertLess(size, MAX_BSON)
        self.assertEqual([doc["page"] for doc in docs], list(range(len(docs))))
        for prev, nxt in zip(docs, docs[1:]):
            self.assertLessEqual(prev["readings"][-1]["ts"], nxt["readings"][0]["ts"],
                                 "pages %d and %d out of time order" % (prev["page"],
                                                                        nxt["page"]))
        self.assertExactlyOnce(docs, sent, seq_field=names[0], daemons=(d,))
        # Pages closed by bytes (check_documents: all but the last at least half of max_bytes).
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 1000,
                                                     max_bytes=self.MAX_BYTES),
                              "invariants", d)
        self.assertVerifyClean(uri, db, 1000)


# ---------------------------------------------------------------------------------------------
# 5. Write cost with holding, time-compressed
# ---------------------------------------------------------------------------------------------

class WriteCost(DocumentModelCase):

    SENSORS = 4
    RATE = 30               # readings per second of wall time, per sensor
    PER_SENSOR = 2100       # two full pages of 1,000 and part of a third
    MAX_DELAY_S = 1.0
    INTERVAL_S = 0.2
    MARGIN_S = 3.0          # the write's own time on a loaded machine
    MAX_RATIO = 20.0

    def test_rewrite_cost_and_visibility_with_holding(self):
        """flush.max_delay 1s, flush.interval 200ms; four sensors send readings stamped 1 s
        apart in one bucket at 30 readings per second of wall time each: one second of wall
        time covers 30 s of sensor time, so each update carries what a 1 Hz sensor gathers in
        the default max_delay of 30 s. 2,100 readings per sensor (two full pages of 1,000 and
        part of a third, ~70 s). The test server's counters give document bytes written by
        updates / bytes stored: at most 20 (DESIGN.md §3.3). While sending, the collection is
        read every half second: a reading must be visible within max_delay + interval + 3 s
        of being sent."""
        self.require_test_server("the rewrite counters ({bucketdTestStats}) are the test "
                                 "server's; a real MongoDB has none")
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db, max_readings=1000, flush_interval="200ms",
                            extra={"flush": {"max_delay": "1s"}}).start()
        # The previous hour: 2,100 s of timestamps fit, all in the past.
        hour0 = (time.time_ns() // (HOUR_S * NS) - 1) * HOUR_S * NS
        sensors = ["cost%d" % s for s in range(self.SENSORS)]
        rewrite_stats(client, db, reset=True)

        sent_at = []            # monotonic time reading index i of every sensor was sent
        sent = []
        worst = 0.0
        checks = 0
        coll = client[db]["buckets"]
        t0 = time.monotonic()
        next_check = t0 + 0.5
        with socket.create_connection(d.addr("tcp"), timeout=DEADLINE) as sock:
            while len(sent_at) < self.PER_SENSOR:
                now = time.monotonic()
                due = min(self.PER_SENSOR, int((now - t0) * self.RATE) + 1)
                lines = []
                for i in range(len(sent_at), due):
                    for s, name in enumerate(sensors):
                        r = reading("cost", {"sensor": name}, 1 + i, hour0 + i * NS,
                                    {"v": float(i % 97) + s, "seq": 1 + i})
                        sent.append(r)
                        lines.append(r.line)
                if lines:
                    sock.sendall(b"\n".join(lines) + b"\n")
                    stamp = time.monotonic()
                    sent_at += [stamp] * (due - len(sent_at))
                if now >= next_check:
                    next_check = now + 0.5
                    t_q = time.monotonic()
                    stored = collections.Counter()
                    for doc in coll.find({}, {"sensor_id": 1, "count": 1}):
                        stored[doc["sensor_id"]] += int(doc["count"])
                    checks += 1
                    for sid in ("cost,sensor=%s" % name for name in sensors):
                        k = stored[sid]
                        if k < len(sent_at):
                            # Reading k (each sensor's are written in order) is not visible
                            # yet at t_q or later: it has waited at least this long.
                            worst = max(worst, t_q - sent_at[k])
                rest = t0 + len(sent_at) / self.RATE - time.monotonic()
                if rest > 0:
                    time.sleep(min(rest, 0.05))  # the sender's pace, not a wait for an event
        elapsed = time.monotonic() - t0
        (st,) = self.settle(client, db, len(sent), [d])
        after = rewrite_stats(client, db)

        ratio = after["docBytesWritten"] / after["storedBytes"]
        per_update = len(sent) / max(after["updatesApplied"], 1)
        bound = self.MAX_DELAY_S + self.INTERVAL_S + self.MARGIN_S
        sys.stderr.write(
            "\n    write cost: %d document bytes written by %d updates for %d bytes stored "
            "(%d documents): %.2f bytes rewritten per byte stored, %.1f readings per update; "
            "sent %d readings in %.1f s; longest wait seen for visibility %.2f s (bound %.1f s, "
            "%d checks)\n" % (after["docBytesWritten"], after["updatesApplied"],
                              after["storedBytes"], after["count"], ratio, per_update,
                              len(sent), elapsed, worst, bound, checks))
        self.assertStat(st, "readings_flushed", len(sent), d)
        for name in ("updates_quarantined", "readings_lost"):
            self.assertStat(st, name, 0, d)
        docs = self.documents(client, db)
        self.assertExactlyOnce(docs, sent, daemons=(d,))
        self.assertNoProblems(bdtest.check_documents(docs, HOUR_S, 1000), "invariants", d)
        self.assertEqual(after["count"], self.SENSORS * 3, "three pages per sensor")
        self.assertGreater(checks, 60, "the collection was read while sending")
        self.assertLessEqual(ratio, self.MAX_RATIO, "bytes rewritten per byte stored")
        self.assertLessEqual(worst, bound, "a reading waited %.2f s to become visible" % worst)


# ---------------------------------------------------------------------------------------------
# 6. Equal timestamps after late data, unstable $sortArray
# ---------------------------------------------------------------------------------------------

class EqualTimestamps(DocumentModelCase):
    """The server's $sortArray returns equal keys in reverse input order (MongoDB documents no
    stability for it). bucketd-schema(7) "DOCUMENT SCHEMA": "`readings` stays sorted by `ts` even when late
    readings arrive (stable for equal times)", i.e. readings with one timestamp keep the order
    they arrived in."""

    mongo_options = {"unstable_sortarray": True}

    def store_with_late_equal_timestamps(self):
        """Ten readings 1 s apart (seq 1..10), stored; then, in one send, late readings: three
        at one new timestamp between the stored 3rd and 4th (seq 11, 12, 13 in this order) and
        one at the stored 6th reading's timestamp (seq 14). Returns (page, sent, the seq order
        the promise gives)."""
        uri, client, db = self.new_database()
        d = self.new_daemon(uri, db).start()
        base = hour_aligned_base(10 * NS, 120 * NS)
        tags = {"site": "eq"}
        first = [reading("eq", tags, 1 + k, base + k * NS, {"v": 100.0 + k, "seq": 1 + k})
                 for k in range(10)]
        send_tcp(d.addr("tcp"), first)
        self.assertEqual(bdtest.wait_stored(client, db, 10, DEADLINE), 10, d.log())
        late = [reading("eq", tags, 11 + k, base + 2500 * MS, {"v": 1.0 + k, "seq": 11 + k})
                for k in range(3)]
        late.append(reading("eq", tags, 14, base + 5 * NS, {"v": 4.0, "seq": 14}))
        send_tcp(d.addr("tcp"), late)
        (st,) = self.settle(client, db, 14, [d])
        self.assertStat(st, "readings_flushed", 14, d)
        docs = self.documents(client, db)
        self.assertEqual(len(docs), 1)
        sent = first + late
        self.assertExactlyOnce(docs, sent, daemons=(d,))
        promised = [1, 2, 3, 11, 12, 13, 4, 5, 6, 14, 7, 8, 9, 10]
        return uri, db, docs[0], sent, promised

    def test_late_readings_are_sorted_by_ts(self):
        uri, db, page, sent, _ = self.store_with_late_equal_timestamps()
        ts = [r["ts"] for r in page["readings"]]
        self.assertEqual(ts, sorted(ts), "readings not sorted by ts")
        by_seq = {r.seq: r.ts_ms for r in sent}
        self.assertEqual([bdtest.dt_ms(r["ts"]) for r in page["readings"]],
                         [by_seq[r["seq"]] for r in page["readings"]])
        self.assertNoProblems(bdtest.check_documents([page], HOUR_S, 3600), "invariants")
        self.assertVerifyClean(uri, db, 3600)

    def test_equal_timestamps_keep_arrival_order(self):
        _, _, page, _, promised = self.store_with_late_equal_timestamps()
        got = [r["seq"] for r in page["readings"]]
        self.assertEqual(got, promised,
                         "readings with equal timestamps are not in arrival order (bucketd-schema(7): "
                         "'stable for equal times'); seq 11-13 share one timestamp, 6 and 14 "
                         "another, sent in that order")


# ---------------------------------------------------------------------------------------------
# 7. A shard key bucketd cannot target
# ---------------------------------------------------------------------------------------------

class MisconfiguredShardKey(DocumentModelCase):
    """The collection sharded on {meta.site: 1}: no upsert filter of bucketd pins it, so every
    update is refused with 61 (ShardKeyNotFound)."""

    mongo_options = {"sharded": "meta.site:1"}
    ATTEMPTS = 20

    def test_code_61_is_retried_logged_once_and_spooled_at_stop(self):
        """The daemon keeps the readings and retries (the proxy counts the attempts), logs one
        error naming the shard key and what to change (at most one every 10 s), quarantines
        nothing and stores nothing; at the stop (flush.stop_timeout 2s) the readings go to the
        spool: readings_spooled is what was sent, readings_lost 0."""
        self.require_test_server("needs the test server's --sharded switch (a shard key "
                                 "bucketd cannot target)")
        uri, client, db = self.new_database()
        proxy, proxied = self.proxy_for(uri, client)
        d = self.new_daemon(proxied, db, extra={"flush": {"stop_timeout": "2s",
                                                          "retry_max": "200ms"}}).start()
        base = hour_aligned_base(60 * NS, 120 * NS)
        sent = [reading("mis", {"site": "s%d" % (k % 3)}, 1 + k, base + k * 100 * MS,
                        {"v": float(k), "seq": 1 + k}) for k in range(60)]
        writes_before = proxy.stats()["writes_forwarded"]
        send_tcp(d.addr("tcp"), sent)
        t_first = time.monotonic()
        line = self.wait_log(d, lambda l: "code 61" in l)
        self.assertTrue(line, "no error for code 61\n" + d.log())
        self.assertTrue(line.startswith("<3>"), line)
        self.assertIn("sharded on a key", line)
        self.assertIn('{sensor_id: "hashed"}', line)
        self.assertIn("retrying", line)
        self.wait_proxy(proxy, "%d attempts" % self.ATTEMPTS,
                        lambda ps: ps["writes_forwarded"] - writes_before >= self.ATTEMPTS, d)
        elapsed = time.monotonic() - t_first
        self.assertTrue(d.alive())
        self.assertEqual(client[db]["buckets"].count_documents({}), 0)
        shard_lines = [l for l in d.log_lines() if "code 61" in l]
        self.assertLessEqual(len(shard_lines), 1 + int(elapsed // 10),
                             "logged more than once every 10 s:\n" + "\n".join(shard_lines))
        self.assertFalse([l for l in d.log_lines() if "quarantin" in l.lower()], d.log())

        st = d.stop()
        attempts = proxy.stats()["writes_forwarded"] - writes_before
        sys.stderr.write("\n    %d bulk writes refused with 61 in %.1f s, %d error lines\n" % (
            attempts, elapsed, len([l for l in d.log_lines() if "code 61" in l])))
        self.assertIsNotNone(st, d.log())
        self.assertStat(st, "readings_lost", 0, d)
        self.assertStat(st, "readings_flushed", 0, d)
        self.assertStat(st, "updates_quarantined", 0, d)
        self.assertStat(st, "readings_quarantined", 0, d)
        self.assertStat(st, "readings_spooled", len(sent), d)
        self.assertGreaterEqual(st["bulk_retries"], self.ATTEMPTS - 1, st)
        spool = d.config["spool"]["dir"]
        self.assertTrue(glob.glob(os.path.join(spool, "spool-*.seg")), os.listdir(spool))
        self.assertFalse(os.path.exists(os.path.join(spool, "dead-letter.jsonl")) and
                         os.path.getsize(os.path.join(spool, "dead-letter.jsonl")) > 0)
        self.assertEqual(client[db]["buckets"].count_documents({}), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
