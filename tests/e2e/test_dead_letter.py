#!/usr/bin/python3
"""End-to-end tests of the dead-letter file and `bucketd-inspect dead-letter list|replay`.

The dead-letter files are written here, in exactly the format src/deadletter.c writes (the
unit test tests/unit/test_deadletter.c pins the same line as test_line_format does here), with
updates built as src/bucket.c builds them; replay then runs against the MongoDB test server, or
the MongoDB of BUCKETD_TEST_MONGODB_URI. The daemon is not needed.

The main scenario: a page the daemon went on writing after one of its updates was refused, a
page only the dead letters hold, and one refusal written down twice. Replay applies each record
once and a second replay changes nothing; the page keeps the daemon's sequence, so a retry of the
daemon's later update still finds it already applied. With a collection validator refusing one
sensor's documents (code 121; skipped when the server enforces no validators) replay first
reports that record refused again, and applies it once the validator is dropped.

Run: /usr/bin/python3 tests/e2e/test_dead_letter.py   (environment: see bdtest.py, plus
BUCKETD_INSPECT_BIN, the tool, default <repo>/build/bucketd-inspect)
"""

import collections
import ctypes
import datetime
import json
import os
import re
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

from bson import json_util  # noqa: E402
from bson.int64 import Int64  # noqa: E402
import pymongo.errors  # noqa: E402

INSPECT = (os.environ.get("BUCKETD_INSPECT_BIN") or
           os.path.join(bdtest.REPO, "build", "bucketd-inspect"))

WRITER = "gw-1"
SPAN_MS = 3600 * 1000
BASE_MS = 1736942400000  # 2025-01-15T12:00:00Z
REFUSED_AT_MS = BASE_MS + 2 * SPAN_MS + 1234
UTC = datetime.timezone.utc
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=UTC)

PLAIN = ("weather,site=roof", "weather", {"site": "roof"})
POISON = ("poison", "poison", {})

REPLAY_RE = re.compile(r"^([0-9a-f]{16}) (.*): (applied|already replayed|refused again "
                       r"\(code (\d+): (.*)\))$")
LIST_RE = re.compile(r"^(\S+)  ([0-9a-f]{16})  (.*)  (\d+) readings  code (-?\d+): (.*)$")

# The line tests/unit/test_deadletter.c expects src/deadletter.c to write for the same record.
GOLDEN = (
    '{ "time" : { "$date" : { "$numberLong" : "1736953200456" } }, '
    '"writer_id" : "gw-1", "seq" : { "$numberLong" : "42" }, '
    '"database" : "telemetry", "collection" : "buckets", '
    '"bucket_id" : "s,a=b|1736949600|0", "n_readings" : { "$numberLong" : "1" }, '
    '"code" : { "$numberLong" : "121" }, "message" : "Document failed validation", '
    '"filter" : { "_id" : "s,a=b|1736949600|0", "w.gw-1" : { "$not" : { "$gte" : '
    '{ "$numberLong" : "42" } } } }, '
    '"update" : [ { "$set" : { "x" : { "$numberDouble" : "21.5" }, '
    '"w.gw-1" : { "$numberLong" : "42" } } }, { "$unset" : "_n" } ] }\n')


def date_ms(ms):
    return EPOCH + datetime.timedelta(milliseconds=ms)


# ---------------------------------------------------------------------------------------------
# The dead-letter format (src/deadletter.c) and the updates (src/bucket.c), rebuilt in Python
# ---------------------------------------------------------------------------------------------

def _emit(v):
    """JSON with libbson's spacing: '{ "k" : v, ... }', '[ a, b ]', empty '{  }' / '[  ]'."""
    if isinstance(v, dict):
        if not v:
            return "{  }"
        return "{ " + ", ".join("%s : %s" % (json.dumps(k, ensure_ascii=False), _emit(x))
                                for k, x in v.items()) + " }"
    if isinstance(v, list):
        if not v:
            return "[  ]"
        return "[ " + ", ".join(_emit(x) for x in v) + " ]"
    if isinstance(v, (str, bool)) or v is None:
        return json.dumps(v, ensure_ascii=False)
    # Canonical extended JSON wraps every number in a {"$number...": "..."} document.
    raise TypeError("unexpected bare value %r" % (v,))


def dead_letter_line(writer_id, seq, database, collection, bucket_id, n_readings, code, message,
                     filt, update, time_ms=REFUSED_AT_MS):
    """One record as src/deadletter.c writes it: canonical extended JSON, keys in this order,
    and a newline."""
    doc = collections.OrderedDict([
        ("time", date_ms(time_ms)), ("writer_id", writer_id), ("seq", Int64(seq)),
        ("database", database), ("collection", collection), ("bucket_id", bucket_id),
        ("n_readings", Int64(n_readings)), ("code", Int64(code)), ("message", message),
        ("filter", filt), ("update", update)])
    text = json_util.dumps(doc, json_options=json_util.CANONICAL_JSON_OPTIONS)
    return _emit(json.loads(text, object_pairs_hook=collections.OrderedDict)) + "\n"


def _add(path, zero, inc):
    return {"$add": [{"$ifNull": ["$" + path, zero]}, inc]}


def _concat():
    return {"$concatArrays": [{"$ifNull": ["$readings", []]}, "$_n"]}


def bucket_update(sensor, start_ms, page, readings, seq, writer=WRITER):
    """(bucket _id, filter, pipeline) of one flush's upsert, as bd_delta_build_update builds it.

    sensor: (sensor_id, measurement, tags); readings: [(ts_ms, {field: value})] with floats
    and Int64 values, each field of one kind."""
    sensor_id, measurement, tags = sensor
    rs = sorted(readings, key=lambda r: r[0])
    bid = "%s|%d|%d" % (sensor_id, start_ms // 1000, page)
    wkey = "w." + writer
    filt = {"_id": bid, wkey: {"$not": {"$gte": Int64(seq)}}}
    new = []
    fields = collections.OrderedDict()
    for ts, values in readings:  # summaries in arrival order, as the delta folds them
        for f, v in values.items():
            fields.setdefault(f, []).append(v)
    for ts, values in rs:
        r = {"ts": date_ms(ts)}
        r.update(values)
        new.append(r)
    set1 = collections.OrderedDict([
        ("_n", {"$literal": new}),
        ("sensor_id", {"$literal": sensor_id}),
        ("meta", {"$literal": {"measurement": measurement, "tags": dict(tags)}}),
        ("bucket_start", date_ms(start_ms)),
        ("bucket_end", date_ms(start_ms + SPAN_MS - 1)),
        ("page", page),
        (wkey, Int64(seq)),
        ("count", _add("count", Int64(0), Int64(len(rs)))),
    ])
    set2 = collections.OrderedDict()
    set2["readings"] = {"$cond": [
        {"$gte": [date_ms(rs[0][0]), {"$arrayElemAt": ["$readings.ts", -1]}]},
        _concat(),
        {"$sortArray": {"input": _concat(), "sortBy": {"ts": 1}}}]}
    for f, vals in fields.items():
        p = "summary.%s." % f
        set1[p + "min"] = {"$min": ["$" + p + "min", min(vals)]}
        set1[p + "max"] = {"$max": ["$" + p + "max", max(vals)]}
        set1[p + "sum"] = _add(p + "sum", 0.0, float(sum(float(v) for v in vals)))
        set1[p + "count"] = _add(p + "count", Int64(0), Int64(len(vals)))
        set2[p + "avg"] = {"$divide": ["$" + p + "sum", "$" + p + "count"]}
    pipeline = [{"$set": set1}, {"$set": set2}, {"$unset": "_n"}]
    return bid, filt, pipeline


def readings_at(start_ms, minutes, seed):
    return [(start_ms + m * 60000, {"temp": 18.0 + ((m * 7 + seed) % 13) * 0.25,
                                    "hum": Int64(35 + (m * 5 + seed) % 14)})
            for m in minutes]


def record_id(writer_id, seq, bucket_id):
    """Hex XXH3-64 of writer_id, NUL, seq in decimal, NUL, bucket_id (libxxhash through ctypes;
    None when the library cannot be loaded)."""
    try:
        lib = ctypes.CDLL("libxxhash.so.0")
    except OSError:
        return None
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    data = b"%s\0%d\0%s" % (writer_id.encode(), seq, bucket_id.encode())
    return "%016x" % lib.XXH3_64bits(data, len(data))


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

class DeadLetterTest(bdtest.E2ECase):
    db_prefix = "bddl"

    def setUp(self):
        super().setUp()
        if not os.access(INSPECT, os.X_OK):
            self.fail("bucketd-inspect not found at %s (set BUCKETD_INSPECT_BIN)" % INSPECT)
        self.spool = os.path.join(self.workdir, "spool")
        os.makedirs(self.spool)
        self.file = os.path.join(self.spool, "dead-letter.jsonl")

    def config(self, uri, database):
        path = os.path.join(self.workdir, "bucketd.yaml")
        cfg = {
            "writer_id": WRITER,
            "listeners": [{"proto": "udp", "bind": "127.0.0.1:%d" % bdtest.free_port("udp")}],
            "mongodb": {"uri": uri, "database": database, "collection": "buckets"},
            "spool": {"dir": self.spool},
        }
        with open(path, "w") as f:
            f.write(bdtest.to_yaml(cfg) + "\n")
        return path

    def inspect(self, *args, timeout=60):
        p = subprocess.run([INSPECT] + list(args), stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=timeout)
        return p.returncode, p.stdout.decode("utf-8", "replace"), \
            p.stderr.decode("utf-8", "replace")

    def write_file(self, lines, path=None):
        with open(path or self.file, "w", encoding="utf-8") as f:
            f.write("".join(lines))

    def replay(self, config, want_rc):
        rc, out, err = self.inspect("-c", config, "dead-letter", "replay")
        self.assertEqual(rc, want_rc, "replay exit %d\n--- stdout\n%s--- stderr\n%s" % (
            rc, out, err))
        results = []
        for line in out.splitlines()[:-1]:
            m = REPLAY_RE.match(line)
            self.assertIsNotNone(m, "unexpected replay line %r in\n%s" % (line, out))
            results.append((m.group(1), m.group(2), m.group(3), m.group(4)))
        return results, out.splitlines()[-1]

    def try_validator(self, db):
        """Create 'buckets' with a validator refusing sensor_id "poison"; skip the test if the
        server does not enforce it (code 121)."""
        try:
            db.create_collection("buckets", validator={"sensor_id": {"$ne": "poison"}})
        except pymongo.errors.OperationFailure as e:
            self.skipTest("the server refuses collection validators: %s" % e)
        try:
            db.buckets.insert_one({"_id": "probe", "sensor_id": "poison"})
        except pymongo.errors.WriteError as e:
            self.assertEqual(e.code, 121, str(e))
            return
        self.skipTest("the server does not enforce collection validators")

    def test_line_format(self):
        """The writer here writes the line the C module writes (the unit test's golden line)."""
        filt = {"_id": "s,a=b|1736949600|0", "w.gw-1": {"$not": {"$gte": Int64(42)}}}
        update = [{"$set": {"x": 21.5, "w.gw-1": Int64(42)}}, {"$unset": "_n"}]
        line = dead_letter_line("gw-1", 42, "telemetry", "buckets", "s,a=b|1736949600|0", 1, 121,
                                "Document failed validation", filt, update,
                                time_ms=1736953200456)
        self.assertEqual(line, GOLDEN)

    def scenario(self, uri, client, dbname):
        """The daemon's pages and the dead-letter file; checks `list`. Returns a dict."""
        coll = client[dbname].buckets
        s = {"config": self.config(uri, dbname), "coll": coll, "start": BASE_MS + SPAN_MS}
        start = s["start"]
        # The daemon's own writes to the plain sensor's page: sequence 11 before the refusal,
        # 50 after it (its readings later than the refused ones).
        s["early"] = readings_at(start, [1, 2], 1)
        s["refused"] = readings_at(start, [5, 3, 4], 2)
        s["later"] = readings_at(start, [10, 11], 3)
        for seq, rs in ((11, s["early"]), (50, s["later"])):
            _, f, u = bucket_update(PLAIN, start, 0, rs, seq)
            coll.update_one(f, u, upsert=True)
        plain_id, plain_f, plain_u = bucket_update(PLAIN, start, 0, s["refused"], 12)
        poisoned = readings_at(start, [7, 8], 4)
        poison_id, poison_f, poison_u = bucket_update(POISON, start, 0, poisoned, 12)
        s["plain_id"], s["poison_id"] = plain_id, poison_id

        line_plain = dead_letter_line(WRITER, 12, dbname, "buckets", plain_id, len(s["refused"]),
                                      2, "a refusal since fixed", plain_f, plain_u)
        self.write_file([
            dead_letter_line(WRITER, 12, dbname, "buckets", poison_id, len(poisoned), 121,
                             "Document failed validation", poison_f, poison_u),
            line_plain,
            line_plain,  # one refusal written down twice
        ])

        # list: one line per record and the total; needs no server.
        rc, out, err = self.inspect("-c", s["config"], "dead-letter", "list")
        self.assertEqual(rc, 0, out + err)
        lines = out.splitlines()
        self.assertEqual(lines[-1], "3 records, 8 readings", out)
        listed = [LIST_RE.match(l) for l in lines[:-1]]
        self.assertTrue(all(listed) and len(listed) == 3, out)
        self.assertEqual([m.group(3) for m in listed], [poison_id, plain_id, plain_id])
        self.assertEqual([m.group(1) for m in listed], ["2025-01-15T14:00:01.234Z"] * 3)
        self.assertEqual(listed[0].group(5), "121")
        self.assertEqual(listed[0].group(6), "Document failed validation")
        ids = {m.group(3): m.group(2) for m in listed}
        rid_plain = record_id(WRITER, 12, plain_id)
        if rid_plain is not None:
            self.assertEqual(ids, {plain_id: rid_plain,
                                   poison_id: record_id(WRITER, 12, poison_id)},
                             "record id = hex XXH3-64 of writer_id, seq and bucket_id")
        s["rid_plain"], s["rid_poison"] = ids[plain_id], ids[poison_id]
        s["t0"] = datetime.datetime.now(UTC) - datetime.timedelta(seconds=5)
        return s

    def check_replayed(self, s, results):
        """After the replay that applied the last record: documents, a third replay, the
        daemon's retry, verify."""
        coll, plain_id, poison_id = s["coll"], s["plain_id"], s["poison_id"]
        rid_plain, rid_poison = s["rid_plain"], s["rid_poison"]
        self.assertEqual([(r[0], r[1]) for r in results],
                         [(rid_poison, poison_id), (rid_plain, plain_id), (rid_plain, plain_id)])
        t1 = datetime.datetime.now(UTC) + datetime.timedelta(seconds=5)

        docs = list(coll.find({}).sort("_id", 1))
        self.assertNoProblems(bdtest.check_documents(docs, 3600, 3600), "after replay")
        by_id = {d["_id"]: d for d in docs}
        self.assertEqual(set(by_id), {plain_id, poison_id})
        plain, poison = by_id[plain_id], by_id[poison_id]
        want = sorted(s["early"] + s["refused"] + s["later"], key=lambda r: r[0])
        self.assertEqual([bdtest.dt_ms(r["ts"]) for r in plain["readings"]],
                         [ts for ts, _ in want])
        self.assertEqual([(r["temp"], r["hum"]) for r in plain["readings"]],
                         [(v["temp"], v["hum"]) for _, v in want])
        self.assertEqual(len(poison["readings"]), 2)
        # The daemon's sequence is untouched: 50 on its page, none on the page only replay made.
        self.assertEqual(plain["w"], {WRITER: 50})
        self.assertIsInstance(plain["w"][WRITER], Int64)
        self.assertNotIn("w", poison)
        for d, rid in ((plain, rid_plain), (poison, rid_poison)):
            self.assertEqual(list(d["replayed"]), [rid])
            when = d["replayed"][rid].replace(tzinfo=UTC)
            self.assertTrue(s["t0"] <= when <= t1, "replayed at %s, not within the run" % when)

        # Another replay changes nothing.
        results, total = self.replay(s["config"], 0)
        self.assertEqual([r[2] for r in results], ["already replayed"] * 3, total)
        self.assertEqual(total, "3 records, 8 readings: 0 applied, 3 already replayed, "
                         "0 refused again")
        self.assertEqual(list(coll.find({}).sort("_id", 1)), docs)

        # The daemon's retry of its sequence-50 update still finds it applied (11000): had the
        # replay set w back to 12, these readings would be stored twice.
        _, f, u = bucket_update(PLAIN, s["start"], 0, s["later"], 50)
        with self.assertRaises(pymongo.errors.DuplicateKeyError):
            coll.update_one(f, u, upsert=True)
        self.assertEqual(list(coll.find({}).sort("_id", 1)), docs)

        # And the schema checker agrees.
        rc, out, err = self.inspect("-c", s["config"], "verify")
        self.assertEqual(rc, 0, out + err)
        self.assertIn("verified 2 documents, 9 readings: 0 problems", out)

    def test_replay_applies_each_record_once(self):
        uri, client, dbname = self.new_database()
        s = self.scenario(uri, client, dbname)
        results, total = self.replay(s["config"], 0)
        self.assertEqual([r[2] for r in results], ["applied", "applied", "already replayed"],
                         total)
        self.assertEqual(total, "3 records, 8 readings: 2 applied, 1 already replayed, "
                         "0 refused again")
        self.check_replayed(s, results)

    def test_refused_then_fixed(self):
        uri, client, dbname = self.new_database()
        db = client[dbname]
        self.try_validator(db)
        s = self.scenario(uri, client, dbname)
        results, total = self.replay(s["config"], 1)
        self.assertEqual([r[2].split(" (")[0] for r in results],
                         ["refused again", "applied", "already replayed"], total)
        self.assertEqual(results[0][3], "121")
        self.assertEqual(total, "3 records, 8 readings: 1 applied, 1 already replayed, "
                         "1 refused again")
        self.assertIsNone(db.buckets.find_one({"_id": s["poison_id"]}))
        # The cause fixed.
        db.command("collMod", "buckets", validator={})
        results, total = self.replay(s["config"], 0)
        self.assertEqual([r[2] for r in results],
                         ["applied", "already replayed", "already replayed"], total)
        self.check_replayed(s, results)

    def test_list_reports_unreadable_lines(self):
        uri, client, dbname = self.new_database()
        config = self.config(uri, dbname)
        bid, f, u = bucket_update(PLAIN, BASE_MS, 0, readings_at(BASE_MS, [1], 0), 3)
        good = dead_letter_line(WRITER, 3, dbname, "buckets", bid, 1, 2, "bad\nvalue", f, u)
        self.write_file([good, "not json\n", "\n", '{"time": 1}\n', good, good[:40]])
        rc, out, err = self.inspect("-c", config, "dead-letter", "list")
        self.assertEqual(rc, 1, out + err)
        lines = out.splitlines()
        self.assertEqual(lines[-1], "2 records, 2 readings, 3 unreadable lines")
        self.assertTrue(LIST_RE.match(lines[0]) and lines[0].endswith("code 2: bad value"),
                        lines[0])
        self.assertRegex(lines[1], r"^%s:2: unreadable record \(not extended JSON" %
                         re.escape(self.file))
        self.assertEqual(lines[2], "%s:4: unreadable record (no date 'time')" % self.file)
        self.assertRegex(lines[4], r":6: unreadable record .*without a newline")

        # No file at the default path: nothing refused (the file was moved away).
        os.unlink(self.file)
        rc, out, err = self.inspect("-c", config, "dead-letter", "list")
        self.assertEqual((rc, out.splitlines()[-1]), (0, "0 records, 0 readings"), out + err)
        # A file named on the command line must exist.
        rc, out, err = self.inspect("-c", config, "dead-letter", "list", "--file", self.file)
        self.assertEqual(rc, 2, out + err)
        self.assertIn(self.file, err)

    def test_dry_run_needs_no_server_and_drops_the_sequence(self):
        port = bdtest.closed_port()
        config = self.config("mongodb://127.0.0.1:%d/?serverSelectionTimeoutMS=500" % port, "x")
        bid, f, u = bucket_update(PLAIN, BASE_MS, 2, readings_at(BASE_MS, [1, 2], 0), 77)
        other = os.path.join(self.workdir, "moved.jsonl")
        self.write_file([dead_letter_line(WRITER, 77, "telemetry", "buckets", bid, 2, 2, "x", f,
                                          u)], other)
        rc, out, err = self.inspect("-c", config, "dead-letter", "replay", "--dry-run",
                                    "--file", other)
        self.assertEqual(rc, 0, out + err)
        lines = out.splitlines()
        self.assertEqual(len(lines), 3, out)
        rid = lines[0].split(" ")[0]
        self.assertEqual(lines[0], "%s %s: would send to telemetry.buckets" % (rid, bid))
        self.assertEqual(lines[2], "1 records, 2 readings: dry run, nothing sent")
        stmt = json_util.loads(lines[1])
        mark = "replayed." + rid
        self.assertEqual(stmt["filter"], {"_id": bid, mark: {"$exists": False}})
        self.assertTrue(stmt["upsert"])
        sent = stmt["update"]
        self.assertEqual(len(sent), len(u) + 1)
        self.assertEqual(list(sent[-1]), ["$set"])
        self.assertEqual(list(sent[-1]["$set"]), [mark])
        self.assertIsInstance(sent[-1]["$set"][mark], datetime.datetime)
        # The record's stages, without the writer's key and otherwise as they were.
        want = json.loads(json_util.dumps(u))
        del want[0]["$set"]["w." + WRITER]
        self.assertEqual(json.loads(json_util.dumps(sent[:-1])), want)

        # Without --dry-run the unreachable server is an error (exit 2), not a refusal.
        t = time.monotonic()
        rc, out, err = self.inspect("-c", config, "dead-letter", "replay", "--file", other)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("cannot reach MongoDB", err)
        self.assertLess(time.monotonic() - t, 30)

    def test_usage_errors(self):
        for args in (["dead-letter"], ["dead-letter", "show"], ["dead-letter", "list", "--dry-run"],
                     ["dead-letter", "replay", "--file"], ["verify", "--file", "x"]):
            rc, out, err = self.inspect(*args)
            self.assertEqual(rc, 2, "%s: %s%s" % (args, out, err))
            self.assertIn("Try 'bucketd-inspect --help'", err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
