#!/usr/bin/python3
"""End-to-end tests of bucketd-inspect: `verify` and `buckets` against bucket documents built
here (correct ones, then one kind of breakage at a time), and `verify` on what the real daemon
wrote.

Run: /usr/bin/python3 tests/e2e/test_inspect.py   (environment: see bdtest.py, plus
BUCKETD_INSPECT_BIN, the tool, default <repo>/build/bucketd-inspect)
"""

import copy
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402
from bdtest import send_readings as sr  # noqa: E402

from bson.int64 import Int64  # noqa: E402

INSPECT = (os.environ.get("BUCKETD_INSPECT_BIN") or
           os.path.join(bdtest.REPO, "build", "bucketd-inspect"))

SPAN_S = 3600
CAP = 6                  # max_readings of the built documents
BASE_S = 1736942400      # 2025-01-15T12:00:00Z
STEP_MS = 5 * 60 * 1000  # readings every 5 minutes from minute 5 of the hour

SUMMARY_RE = re.compile(r"^verified (\d+) documents, (\d+) readings: (\d+) problems"
                        r"(?:, (\d+) warnings)?$", re.M)

UTC = datetime.timezone.utc
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=UTC)


def date_ms(ms):
    return EPOCH + datetime.timedelta(milliseconds=ms)


def rfc3339(s):
    return datetime.datetime.fromtimestamp(s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def make_doc(sensor, measurement, tags, start_s, page, readings):
    """A correct bucket page; readings: list of (offset in ms from start, {field: value})."""
    rs = []
    fields = []
    for off, values in readings:
        r = {"ts": date_ms(start_s * 1000 + off)}
        r.update(values)
        rs.append(r)
        fields.extend(f for f in values if f not in fields)
    summary = {}
    for f in fields:
        nums = [r[f] for r in rs if f in r and is_number(r[f])]
        if not nums:
            continue
        total = math.fsum(float(v) for v in nums)
        summary[f] = {"min": min(nums), "max": max(nums), "sum": total,
                      "count": Int64(len(nums)), "avg": total / len(nums)}
    return {
        "_id": "%s|%d|%d" % (sensor, start_s, page),
        "sensor_id": sensor,
        "meta": {"measurement": measurement, "tags": tags},
        "bucket_start": date_ms(start_s * 1000),
        "bucket_end": date_ms(start_s * 1000 + SPAN_S * 1000 - 1),
        "page": page,
        "count": Int64(len(rs)),
        "readings": rs,
        "summary": summary,
    }


def weather_readings(first, n, seed):
    """n readings numbered from first: float temp, int64 hum, int32 lvl, bool ok (every 2nd)."""
    out = []
    for k in range(first, first + n):
        values = {"temp": round(18.0 + ((k * 7 + seed) % 13) * 0.35 - 0.1, 3),
                  "hum": Int64(35 + (k * 5 + seed) % 14),
                  "lvl": (k * 3 + seed) % 9 - 4}
        if k % 2:
            values["ok"] = bool((k + seed) % 3)
        out.append(((k + 1) * STEP_MS, values))
    return out


ROOF = ("weather,site=roof", "weather", {"site": "roof"})
YARD = ("weather,site=yard", "weather", {"site": "yard"})
BOILER = ("plant.boiler.temp", "plant.boiler.temp", {})


def hour(h):
    return BASE_S + h * SPAN_S


def good_documents():
    """Three sensors over three hours; roof's 13:00 bucket has two pages (6 + 3 readings)."""
    docs = [
        make_doc(*ROOF, hour(0), 0, weather_readings(0, 5, 1)),
        make_doc(*ROOF, hour(1), 0, weather_readings(0, CAP, 2)),
        make_doc(*ROOF, hour(1), 1, weather_readings(CAP, 3, 2)),
        make_doc(*ROOF, hour(2), 0, weather_readings(0, 4, 3)),
        make_doc(*YARD, hour(0), 0, weather_readings(0, 4, 4)),
        make_doc(*YARD, hour(1), 0, weather_readings(0, 2, 5)),
        make_doc(*BOILER, hour(2), 0, [((k + 1) * STEP_MS, {"value": 70.0 + k * 0.1})
                                       for k in range(CAP)]),
    ]
    # The daemon adds per flush, so its sum may differ from an exact one in the last bits:
    # within the tolerance, that is no problem.
    s = docs[0]["summary"]["temp"]
    s["sum"] *= 1 + 4e-15
    s["avg"] = s["sum"] / s["count"]
    return docs


def ids(*parts):
    """_id of (sensor triple, hour, page)."""
    (sensor, _, _), h, page = parts
    return "%s|%d|%d" % (sensor, hour(h), page)


YARD0 = ids(YARD, 0, 0)  # the document each breakage below damages (4 readings, one page)


def find(docs, _id):
    for d in docs:
        if d["_id"] == _id:
            return d
    raise KeyError(_id)


# -- breakages: each takes the good documents, damages one, returns (its _id, what to expect) --

def b_count(docs):
    find(docs, YARD0)["count"] = Int64(5)
    return YARD0, r"count does not match the number of readings \(expected 4, found 5\)"


def b_order(docs):
    rs = find(docs, YARD0)["readings"]
    rs[1]["ts"], rs[2]["ts"] = rs[2]["ts"], rs[1]["ts"]
    return YARD0, r"readings\[2\] is out of time order \(expected ts >= 2025-01-15T12:15:00Z, " \
                  r"found 2025-01-15T12:10:00Z\)"


def b_outside(docs):
    d = find(docs, YARD0)
    d["readings"][-1]["ts"] = date_ms(hour(1) * 1000)
    return YARD0, r"readings\[3\]\.ts is outside the bucket \(expected 2025-01-15T12:00:00Z .. " \
                  r"2025-01-15T12:59:59.999Z, found 2025-01-15T13:00:00Z\)"


def b_misaligned(docs):
    d = find(docs, YARD0)
    docs.remove(d)
    shift = datetime.timedelta(seconds=60)
    d["bucket_start"] += shift
    d["bucket_end"] += shift
    d["_id"] = "%s|%d|0" % (YARD[0], hour(0) + 60)
    docs.append(d)
    return d["_id"], r"bucket_start is not aligned to the 1h span \(expected " \
                     r"2025-01-15T12:00:00Z, found 2025-01-15T12:01:00Z\)"


def b_end(docs):
    d = find(docs, YARD0)
    d["bucket_end"] = date_ms(hour(1) * 1000)
    return YARD0, r"bucket_end is not bucket_start \+ span - 1 ms \(expected " \
                  r"2025-01-15T12:59:59.999Z, found 2025-01-15T13:00:00Z\)"


def b_min(docs):
    s = find(docs, YARD0)["summary"]["temp"]
    want = s["min"]
    s["min"] = want - 1
    return YARD0, r"summary\.temp\.min is wrong \(expected %s, found %s\)" % (
        re.escape(repr(want)), re.escape(repr(want - 1)))


def b_max(docs):
    s = find(docs, YARD0)["summary"]["hum"]
    want = int(s["max"])
    s["max"] = Int64(want + 1)
    return YARD0, r"summary\.hum\.max is wrong \(expected %d, found %d\)" % (want, want + 1)


def b_summary_count(docs):
    s = find(docs, YARD0)["summary"]["lvl"]
    s["count"] = Int64(3)
    return YARD0, r"summary\.lvl\.count is wrong \(expected 4, found 3\)"


def b_sum(docs):
    s = find(docs, YARD0)["summary"]["temp"]
    s["sum"] *= 1 + 1e-6  # avg stays true to the readings: only the sum is wrong
    return YARD0, r"summary\.temp\.sum is wrong \(expected [-0-9.e]+, found [-0-9.e]+\)"


def b_avg(docs):
    s = find(docs, YARD0)["summary"]["hum"]
    s["avg"] += 0.5
    return YARD0, r"summary\.hum\.avg is wrong \(expected [-0-9.e]+, found [-0-9.e]+\)"


def b_no_summary(docs):
    del find(docs, YARD0)["summary"]["hum"]
    return YARD0, r"summary\.hum is missing \(expected a summary of 4 numeric readings, " \
                  r"found nothing\)"


def b_bool_summary(docs):
    find(docs, YARD0)["summary"]["ok"] = {"min": 0, "max": 1, "sum": 1.0,
                                          "count": Int64(2), "avg": 0.5}
    return YARD0, r"summary\.ok summarises a field without numeric readings \(expected no " \
                  r"summary, found one\)"


def b_over_cap(docs):
    docs.remove(find(docs, YARD0))
    docs.append(make_doc(*YARD, hour(0), 0, weather_readings(0, CAP + 1, 4)))
    return YARD0, r"page holds more readings than max_readings \(expected at most %d, " \
                  r"found %d\)" % (CAP, CAP + 1)


def b_id(docs):
    d = find(docs, YARD0)
    d["_id"] = "%s|%d|1" % (YARD[0], hour(0))
    return d["_id"], r"_id does not match sensor_id, bucket_start and page \(expected %s, " \
                     r"found %s\)" % (re.escape(YARD0), re.escape(d["_id"]))


def b_type(docs):
    find(docs, YARD0)["count"] = "4"
    return YARD0, r"count has the wrong type \(expected int64, found string\)"


def b_missing(docs):
    del find(docs, YARD0)["bucket_end"]
    return YARD0, r"bucket_end is missing \(expected date, found nothing\)"


def b_meta(docs):
    d = find(docs, ids(ROOF, 1, 1))
    d["meta"] = {"measurement": "weather", "tags": {"site": "attic"}}
    return d["_id"], r"meta differs from that of %s, a page of the same bucket \(expected .*" \
                     r"roof.*, found .*attic.*\)" % re.escape(ids(ROOF, 1, 0))


BREAKAGES = [
    ("count", b_count), ("order", b_order), ("outside", b_outside),
    ("misaligned", b_misaligned), ("bucket_end", b_end), ("min", b_min), ("max", b_max),
    ("summary_count", b_summary_count), ("sum", b_sum), ("avg", b_avg),
    ("no_summary", b_no_summary), ("bool_summary", b_bool_summary), ("over_cap", b_over_cap),
    ("bad_id", b_id), ("wrong_type", b_type), ("missing_field", b_missing), ("meta", b_meta),
]


def inspect(*args, timeout=60):
    p = subprocess.run([INSPECT] + [str(a) for a in args], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=timeout)
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


def summary_of(out):
    m = SUMMARY_RE.search(out)
    if m is None:
        return None
    return tuple(int(g or 0) for g in m.groups())


class Inspect(bdtest.E2ECase):
    db_prefix = "inspect"

    def setUp(self):
        super().setUp()
        if not os.access(INSPECT, os.X_OK):
            self.fail("bucketd-inspect not found at %s (set BUCKETD_INSPECT_BIN)" % INSPECT)

    def load(self, client, db, collection, docs):
        # Inserted in reverse so that the tool's sort, not insertion order, makes its output.
        client[db][collection].insert_many(copy.deepcopy(list(reversed(docs))))

    def conn(self, uri, db, collection):
        return ["--uri", uri, "--database", db, "--collection", collection]

    def test_verify_good_then_each_breakage(self):
        uri, client, db = self.new_database("insp_verify")
        good = good_documents()
        self.load(client, db, "good", good)
        rc, out, err = inspect(*self.conn(uri, db, "good"), "verify", "--max-readings", CAP)
        self.assertEqual(rc, 0, out + err)
        n_readings = sum(len(d["readings"]) for d in good)
        self.assertEqual(summary_of(out), (len(good), n_readings, 0, 0), out)
        self.assertEqual(out.strip().count("\n"), 0, "only the summary line: " + out)

        # One sensor only.
        rc, out, err = inspect(*self.conn(uri, db, "good"), "verify", "--sensor", YARD[0],
                               "--max-readings", CAP)
        self.assertEqual(rc, 0, out + err)
        self.assertEqual(summary_of(out), (2, 6, 0, 0), out)

        for name, breakage in BREAKAGES:
            with self.subTest(breakage=name):
                docs = good_documents()
                target, what = breakage(docs)
                coll = "broken_" + name
                self.load(client, db, coll, docs)
                rc, out, err = inspect(*self.conn(uri, db, coll), "verify",
                                       "--max-readings", CAP)
                self.assertEqual(rc, 1, out + err)
                pattern = r"^%s: %s$" % (re.escape(target), what)
                self.assertRegex(out, re.compile(pattern, re.M))
                # Each breakage is exactly one problem: the checks do not cascade.
                got = summary_of(out)
                self.assertIsNotNone(got, out)
                self.assertEqual(got[0], len(docs), out)
                self.assertEqual(got[2], 1, out)

    def test_verify_warns_on_page_gaps(self):
        """A missing page 0 (a quarantined update) is a warning: exit 0."""
        uri, client, db = self.new_database("insp_gap")
        docs = [d for d in good_documents() if d["_id"] != ids(ROOF, 1, 0)]
        self.load(client, db, "b", docs)
        rc, out, err = inspect(*self.conn(uri, db, "b"), "verify", "--max-readings", CAP)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("%s: warning: pages of this bucket are not numbered 0..k (expected page 0, "
                      "found page 1)" % ids(ROOF, 1, 1), out)
        self.assertEqual(summary_of(out)[2:], (0, 1), out)

        # A short page followed by another one: a warning too.
        docs = good_documents()
        docs.remove(find(docs, ids(ROOF, 1, 0)))
        docs.append(make_doc(*ROOF, hour(1), 0, weather_readings(0, CAP - 1, 2)))
        self.load(client, db, "c", docs)
        rc, out, err = inspect(*self.conn(uri, db, "c"), "verify", "--max-readings", CAP)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("%s: warning: page is not full but a later page exists (expected %d "
                      "readings, found %d)" % (ids(ROOF, 1, 0), CAP, CAP - 1), out)

    def test_buckets_json_and_table(self):
        uri, client, db = self.new_database("insp_buckets")
        good = good_documents()
        self.load(client, db, "b", good)
        conn = self.conn(uri, db, "b")

        def json_ids(*args):
            rc, out, err = inspect(*conn, "buckets", "--sensor", ROOF[0], *args)
            self.assertEqual(rc, 0, out + err)
            docs = [json.loads(line) for line in out.splitlines()]
            return docs, [d["_id"] for d in docs]

        # Everything of the sensor, sorted by bucket_start then page.
        docs, got = json_ids()
        self.assertEqual(got, [ids(ROOF, 0, 0), ids(ROOF, 1, 0), ids(ROOF, 1, 1),
                               ids(ROOF, 2, 0)])
        # Relaxed extended JSON: dates as $date, int64 as plain numbers, readings included.
        d = docs[1]
        self.assertEqual(d["bucket_start"], {"$date": "2025-01-15T13:00:00Z"})
        self.assertEqual(d["bucket_end"], {"$date": "2025-01-15T13:59:59.999Z"})
        self.assertEqual(d["count"], CAP)
        self.assertEqual(len(d["readings"]), CAP)
        want = find(good, ids(ROOF, 1, 0))
        self.assertEqual(d["summary"]["temp"]["max"], want["summary"]["temp"]["max"])
        self.assertEqual(d["meta"], want["meta"])

        # --from in the middle of an hour takes that hour's bucket; --to is exclusive.
        _, got = json_ids("--from", "2025-01-15T13:30:00Z", "--to", hour(2))
        self.assertEqual(got, [ids(ROOF, 1, 0), ids(ROOF, 1, 1)])
        _, got = json_ids("--from", hour(2), "--json")
        self.assertEqual(got, [ids(ROOF, 2, 0)])
        _, got = json_ids("--to", "2025-01-15T14:00:00+01:00")
        self.assertEqual(got, [ids(ROOF, 0, 0)])
        _, got = json_ids("--from", "2025-01-16T00:00:00Z")
        self.assertEqual(got, [])

        # The table combines the two pages of 13:00.
        rc, out, err = inspect(*conn, "buckets", "--sensor", ROOF[0], "--table")
        self.assertEqual(rc, 0, out + err)
        lines = out.splitlines()
        self.assertEqual(len(lines), 4, out)
        header = lines[0].split()
        rows = {r.split()[0]: dict(zip(header, r.split())) for r in lines[1:]}
        self.assertEqual(list(rows), [rfc3339(hour(h)) for h in range(3)])
        row = rows[rfc3339(hour(1))]
        pages = [find(good, ids(ROOF, 1, 0)), find(good, ids(ROOF, 1, 1))]
        self.assertEqual(row["pages"], "2")
        self.assertEqual(row["count"], str(CAP + 3))
        for f in ("temp", "hum", "lvl"):
            sums = [p["summary"][f] for p in pages]
            self.assertEqual(float(row[f + ".min"]), min(s["min"] for s in sums), f)
            self.assertEqual(float(row[f + ".max"]), max(s["max"] for s in sums), f)
            avg = sum(s["sum"] for s in sums) / sum(s["count"] for s in sums)
            self.assertAlmostEqual(float(row[f + ".avg"]), avg, places=9, msg=f)
        self.assertNotIn("ok.min", header, "bool fields have no summary")
        self.assertEqual(rows[rfc3339(hour(0))]["pages"], "1")

    def test_connection_failure_and_usage(self):
        port = bdtest.closed_port()
        uri = "mongodb://127.0.0.1:%d/?serverSelectionTimeoutMS=300" % port
        for args in (["verify"], ["buckets", "--sensor", "x", "--table"]):
            with self.subTest(args=args):
                t0 = time.monotonic()
                rc, out, err = inspect("--uri", uri, *args)
                self.assertEqual(rc, 2, out + err)
                self.assertIn("cannot reach MongoDB", err)
                self.assertIn("127.0.0.1:%d" % port, err)
                # It gives up after the URI's 300 ms, not the driver's default 30 s: any
                # bound between the two would do; the widest keeps a loaded machine out of it.
                self.assertLess(time.monotonic() - t0, 20)
        for args in ([], ["frobnicate"], ["buckets"], ["verify", "--from", "1"],
                     ["buckets", "--sensor", "x", "--from", "yesterday"],
                     ["verify", "--span", "7m"], ["verify", "--max-readings", "0"],
                     ["--uri", "http://nope", "verify"], ["-c", "/nonexistent.yaml", "verify"]):
            with self.subTest(args=args):
                rc, out, err = inspect(*args)
                self.assertEqual(rc, 2, out + err)
                self.assertTrue(err.startswith("bucketd-inspect: "), err)
        rc, out, _ = inspect("--help")
        self.assertEqual(rc, 0)
        self.assertIn("verify", out)
        rc, out, _ = inspect("--version")
        self.assertEqual(rc, 0)
        self.assertRegex(out, r"^bucketd-inspect \d+\.\d+\.\d+\n$")

    def test_config_file(self):
        uri, client, db = self.new_database("insp_config")
        self.load(client, db, "from_config", good_documents())
        broken = good_documents()
        target, what = b_count(broken)
        self.load(client, db, "broken", broken)
        # The daemon's own config file: connection, page cap and span all come from it.
        cfg = bdtest.Daemon(os.path.join(self.workdir, "cfg"), uri, db,
                            collection="from_config", max_readings=CAP).write_config()
        rc, out, err = inspect("-c", cfg, "verify")
        self.assertEqual(rc, 0, out + err)
        self.assertEqual(summary_of(out)[:3], (7, 30, 0), out)
        # An explicit option overrides the file.
        rc, out, err = inspect("-c", cfg, "--collection", "broken", "verify")
        self.assertEqual(rc, 1, out + err)
        self.assertRegex(out, re.compile(r"^%s: %s$" % (re.escape(target), what), re.M))
        rc, out, err = inspect("-c", cfg, "verify", "--max-readings", CAP - 1)
        self.assertEqual(rc, 1, out + err)
        self.assertIn("more readings than max_readings", out)
        rc, out, err = inspect("--config", cfg, "buckets", "--sensor", BOILER[0])
        self.assertEqual(rc, 0, out + err)
        self.assertEqual([json.loads(x)["_id"] for x in out.splitlines()], [ids(BOILER, 2, 0)])

    def test_verify_what_the_daemon_wrote(self):
        """The real daemon, a few hundred readings over three hours, pages of 10: no problem."""
        uri, client, db = self.new_database("insp_daemon")
        d = self.daemon(uri, db, max_readings=10)
        readings = sr.make_readings(sensors=6, per_sensor=60, seed=31)
        main, late = sr.split_late(sr.shuffle(readings, seed=32), fraction=0.1, seed=32)
        d.start()
        # The late readings go out once the others are stored (their newer buckets written),
        # and the daemon is stopped once everything is: waits on the documents, not sleeps.
        kw = {"udp": d.addr("udp"), "tcp": d.addr("tcp"), "lines_per_datagram": 4}
        sent = sr.send(main, **kw)["readings"]
        self.assertEqual(bdtest.wait_stored(client, db, len(main), 120), len(main), d.log())
        sent += sr.send(late, **kw)["readings"]
        self.assertEqual(bdtest.wait_stored(client, db, len(readings), 120), len(readings),
                         d.log())
        stats = d.stop()
        self.assertStat(stats, "readings_flushed", sent, d)
        self.assertEqual(sent, len(readings))
        n_docs = client[db]["buckets"].count_documents({})
        self.assertGreater(n_docs, 6 * 3, "pages of 10 should overflow")
        rc, out, err = inspect("-c", d.config_path, "verify")
        self.assertEqual(rc, 0, out + err)
        self.assertEqual(summary_of(out), (n_docs, len(readings), 0, 0), out)


if __name__ == "__main__":
    unittest.main()
