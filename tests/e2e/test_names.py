#!/usr/bin/python3
"""End-to-end: field and tag names MongoDB cannot address as paths are stored escaped, never
dropped (bucketd-schema(7) "Field and tag names"), and bucketd-inspect shows them as they were sent.

Run: /usr/bin/python3 tests/e2e/test_names.py   (environment: see bdtest.py, plus
BUCKETD_INSPECT_BIN for bucketd-inspect, default <repo>/build/bucketd-inspect)
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

INSPECT = (os.environ.get("BUCKETD_INSPECT_BIN") or
           os.path.join(bdtest.REPO, "build", "bucketd-inspect"))
SPAN_S = 3600
DEADLINE = 120.0
NS_PER_S = 1000 * 1000 * 1000

SENSOR = "pods,host.name=y,k8s.pod=x"     # the series key: tags sorted, kept raw
UNESCAPE = re.compile(r"%(25|2[Ee]|24|74)")


def escape(name, field=True):
    """The escape of bucketd-schema(7) "Field and tag names", written out independently of src/names.c."""
    if field and name == "ts":
        return "%74s"
    out = name.replace("%", "%25").replace(".", "%2E")
    return "%24" + out[1:] if out.startswith("$") else out


def unescape(key):
    return UNESCAPE.sub(lambda m: chr(int(m.group(1), 16)), key)


def inspect(*args):
    p = subprocess.run([INSPECT] + [str(a) for a in args], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=60)
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


class FieldAndTagNames(bdtest.E2ECase):
    db_prefix = "names"

    def send_and_store(self):
        """Lines whose tag keys and field names need the escape, over TCP and UDP; returns
        (client, db, daemon, stats, sent) with sent: {ts_ms: {field name: value}}."""
        uri, client, db = self.new_database("names")
        d = self.daemon(uri, db)
        d.start()
        # A minute into the previous hour: every reading in one bucket, well inside max_late.
        base = ((time.time_ns() // NS_PER_S - SPAN_S) // SPAN_S * SPAN_S + 60) * NS_PER_S
        sent = {}
        lines = []
        for i in range(10):
            ts = base + i * NS_PER_S
            # The tags in another order than the series key's: bucketd sorts them.
            lines.append(b"pods,k8s.pod=x,host.name=y cpu.user=%d,$x=%d %d" % (1 + i, 2 + i, ts))
            sent[ts // 1000000] = {"cpu.user": float(1 + i), "$x": float(2 + i)}
        ts = base + 30 * NS_PER_S
        lines.append(b"pods,host.name=y,k8s.pod=x ts=3,50%%=4i,a.$b=5,%%2E=6,plain=7 %d" % ts)
        sent[ts // 1000000] = {"ts": 3.0, "50%": 4, "a.$b": 5.0, "%2E": 6.0, "plain": 7.0}
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with udp, socket.create_connection(d.addr("tcp"), timeout=DEADLINE) as tcp:
            for i, line in enumerate(lines):
                if i % 2:
                    udp.sendto(line + b"\n", d.addr("udp"))
                else:
                    tcp.sendall(line + b"\n")
        stored = bdtest.wait_stored(client, db, len(lines), DEADLINE)
        self.assertEqual(stored, len(lines), "readings stored\n" + bdtest.log_tail(d.log()))
        stats = d.stop()
        return client, db, d, stats, sent

    def test_escaped_names_are_stored_and_read_back(self):
        client, db, d, stats, sent = self.send_and_store()
        # Nothing dropped.
        self.assertStat(stats, "readings_accepted", len(sent), d)
        self.assertStat(stats, "readings_flushed", len(sent), d)
        for name, value in sorted(stats.items()):
            if name.startswith("drop_"):
                self.assertStat(stats, name, 0, d)

        docs = self.documents(client, db)
        self.assertEqual(len(docs), 1, docs)
        doc = docs[0]
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, 3600), "invariants", d)
        self.assertEqual(doc["sensor_id"], SENSOR)
        self.assertTrue(doc["_id"].startswith(SENSOR + "|"), doc["_id"])
        self.assertEqual(doc["meta"], {"measurement": "pods",
                                       "tags": {"host%2Ename": "y", "k8s%2Epod": "x"}})

        # Every reading, with its stored keys and values, against what was sent.
        got = {}
        for r in doc["readings"]:
            ts_ms = bdtest.dt_ms(r["ts"])
            got[ts_ms] = {k: v for k, v in r.items() if k != "ts"}
        want = {ts: {escape(k): v for k, v in fields.items()} for ts, fields in sent.items()}
        self.assertEqual(got, want)
        self.assertEqual(sorted(got[max(got)]), ["%252E", "%74s", "50%25", "a%2E$b", "plain"])
        self.assertIsInstance(got[max(got)]["50%25"], int)
        # And the escape reverses to the names as sent.
        self.assertEqual({ts: {unescape(k): v for k, v in f.items()} for ts, f in got.items()},
                         sent)

        # Summaries under the same escaped names.
        self.assertEqual(sorted(doc["summary"]), sorted(["cpu%2Euser", "%24x", "%74s", "50%25",
                                                         "a%2E$b", "%252E", "plain"]))
        cpu = doc["summary"]["cpu%2Euser"]
        self.assertEqual((cpu["min"], cpu["max"], cpu["count"], cpu["avg"]), (1.0, 10.0, 10, 5.5))
        self.assertEqual(doc["summary"]["%24x"]["sum"], sum(range(2, 12)))

        # The escaped names are ordinary paths: queries reach them.
        coll = client[db]["buckets"]
        self.assertEqual(coll.count_documents({"meta.tags.k8s%2Epod": "x"}), 1)
        self.assertEqual(coll.count_documents({"readings.cpu%2Euser": 7.0}), 1)
        self.assertEqual(coll.count_documents({"summary.%24x.max": 11.0}), 1)
        self.assertEqual(coll.count_documents({"readings.%74s": 3.0}), 1)
        hourly = list(coll.find({"sensor_id": SENSOR}, {"_id": 0, "summary.cpu%2Euser.avg": 1}))
        self.assertEqual(hourly, [{"summary": {"cpu%2Euser": {"avg": 5.5}}}])
        # bucketd-schema(7)'s aggregation example.
        agg = list(coll.aggregate([{"$project": {"_id": 0, "cpu": "$summary.cpu%2Euser.avg",
                                                 "x": "$summary.%24x.max"}}]))
        self.assertEqual(agg, [{"cpu": 5.5, "x": 11.0}])

        self.check_inspect(d, sent)

    def check_inspect(self, d, sent):
        if not os.access(INSPECT, os.X_OK):
            self.fail("bucketd-inspect not found at %s (set BUCKETD_INSPECT_BIN)" % INSPECT)
        conn = ["-c", d.config_path]

        # JSON: the names as sent; --raw-names: as stored.
        rc, out, err = inspect(*conn, "buckets", "--sensor", SENSOR)
        self.assertEqual(rc, 0, out + err)
        shown = json.loads(out)
        self.assertEqual(shown["meta"]["tags"], {"host.name": "y", "k8s.pod": "x"})
        self.assertEqual(sorted(shown["summary"]),
                         sorted(["cpu.user", "$x", "ts", "50%", "a.$b", "%2E", "plain"]))
        readings = {r["ts"]["$date"]: r for r in shown["readings"]}
        self.assertEqual(len(readings), len(sent))
        last = shown["readings"][-1]
        # In a reading, a field named ts keeps its stored name beside the timestamp.
        self.assertEqual(sorted(last), sorted(["ts", "%74s", "50%", "a.$b", "%2E", "plain"]))
        self.assertEqual(shown["readings"][0]["cpu.user"], 1.0)
        self.assertEqual(shown["readings"][0]["$x"], 2.0)

        rc, out, err = inspect(*conn, "buckets", "--sensor", SENSOR, "--raw-names")
        self.assertEqual(rc, 0, out + err)
        raw = json.loads(out)
        self.assertEqual(raw["meta"]["tags"], {"host%2Ename": "y", "k8s%2Epod": "x"})
        self.assertIn("cpu%2Euser", raw["summary"])
        self.assertIn("%24x", raw["readings"][0])

        # Table columns by name as sent, or as stored.
        rc, out, err = inspect(*conn, "buckets", "--sensor", SENSOR, "--table")
        self.assertEqual(rc, 0, out + err)
        header, row = [line.split() for line in out.splitlines()]
        cells = dict(zip(header, row))
        self.assertEqual(cells["cpu.user.max"], "10")
        self.assertEqual(cells["$x.min"], "2")
        self.assertEqual(cells["ts.avg"], "3")
        rc, out, err = inspect(*conn, "buckets", "--sensor", SENSOR, "--table", "--raw-names")
        self.assertEqual(rc, 0, out + err)
        self.assertIn("cpu%2Euser.max", out.split())

        # verify finds nothing wrong with escaped names.
        rc, out, err = inspect(*conn, "verify")
        self.assertEqual(rc, 0, out + err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
