"""End-to-end: GET /sensors and bucketd_sensors_silent of the real daemon (src/metrics.c,
src/sensorlist.c, the sensor table's listing), and `bucketd-inspect sensors --silent`.

- a sensor that stops sending is listed under ?silent=1s once a second has passed since it was
  sent, and never in an answer that came back sooner (checked against the test's own clock:
  timing-free), with the readings it was sent and a last_seen between the send's start and end;
- paging with limit/after lists every sensor exactly once, in last_seen order, while new
  sensors arrive between pages;
- hostile ids (quotes, backslashes, C1 controls, bidi overrides) come back in valid JSON as the
  text sent, with no raw terminal control byte in the body; ids with C0 control bytes or
  invalid UTF-8 are refused by the parser and never listed;
- limit bounds and bad parameters answer 400 with a JSON reason naming the parameter;
- bucketd_sensors_silent counts the silent sensors (metrics.silent_after 1s), follows a reload
  of metrics.silent_after, and disappears with 0;
- bucketd-inspect sensors --silent, on what a real daemon wrote (summaries of readings hours
  old and of readings now), lists the old sensor only.

Run: /usr/bin/python3 tests/e2e/test_sensors.py   (see bdtest.py for the environment, plus
BUCKETD_INSPECT_BIN, default <repo>/build/bucketd-inspect)
"""

import datetime
import json
import os
import socket
import subprocess
import sys
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

INSPECT = (os.environ.get("BUCKETD_INSPECT_BIN") or
           os.path.join(bdtest.REPO, "build", "bucketd-inspect"))
DEADLINE = 60.0
# Bytes a terminal acts on, which must never reach the body raw.
RAW_CONTROLS = [c.encode() for c in ("\u009b", "\u0085", "\u202e")]


http_get = bdtest.http_get


def sensors_page(port, query=""):
    """(status, decoded JSON, raw body) of GET /sensors?query; the body must be UTF-8 JSON."""
    status, headers, body = http_get(port, "/sensors" + ("?" + query if query else ""))
    assert headers.get("Content-Type") == "application/json", headers
    return status, json.loads(body.decode("utf-8")), body


def all_sensors(port, query="", limit=1000):
    """Every sensor /sensors lists, following "next"."""
    out, after = [], None
    for _ in range(10000):
        q = [query] if query else []
        q.append("limit=%d" % limit)
        if after is not None:
            q.append("after=" + urllib.parse.quote(after))
        status, page, _ = sensors_page(port, "&".join(q))
        assert status == 200, page
        out += page["sensors"]
        after = page["next"]
        if after is None:
            return out
    raise AssertionError("paging did not end")


def parse_time(s):
    return datetime.datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def scrape_value(port, name):
    """The unlabelled sample name, or None."""
    return bdtest.scrape(port)[1].get((name, ""))


def dropped_total(port):
    """bucketd_dropped_total summed over its reasons."""
    return sum(v for (name, _), v in bdtest.scrape(port)[1].items()
               if name == "bucketd_dropped_total")


def udp_send(addr, lines):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for line in lines:
            s.sendto(line + b"\n", addr)
    finally:
        s.close()


def tcp_send(addr, lines):
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(b"".join(line + b"\n" for line in lines))


class Sensors(bdtest.E2ECase):
    db_prefix = "e2e_sensors"

    def sensors_daemon(self, extra=None, **kw):
        uri, client, db = self.new_database()
        port = bdtest.free_port()
        cfg = {"metrics": {"bind": "127.0.0.1:%d" % port, "silent_after": "1s"}}
        listeners = [{"name": "udp", "proto": "udp"}, {"name": "tcp", "proto": "tcp"},
                     {"name": "graphite", "proto": "udp", "format": "graphite"}]
        d = self.daemon(uri, db, listeners=listeners,
                        extra=bdtest.deep_merge(cfg, extra or {}), **kw)
        d.metrics_port = port
        d.start()
        return d, client, db

    def wait_listed(self, port, sensor_ids, query=""):
        """Poll until every id in sensor_ids is listed; returns the listing."""
        want = set(sensor_ids)
        got = bdtest.wait_for(
            lambda: (lambda l: l if want <= {s["sensor_id"] for s in l} else None)(
                all_sensors(port, query)), DEADLINE)
        self.assertTrue(got, "not all of %r listed by /sensors?%s within %.0fs" % (
            sorted(want)[:5], query, DEADLINE))
        return got

    # -- silent ------------------------------------------------------------------------------
    def test_a_sensor_that_stops_is_listed_after_the_duration_and_not_before(self):
        d, _, _ = self.sensors_daemon()
        port = d.metrics_port
        t_before = time.time()
        udp_send(d.addr("udp"), [b"stops,site=roof v=1", b"stops,site=roof v=2"])
        t_after = time.time()
        listed = self.wait_listed(port, ["stops,site=roof"])
        t_listed = time.time()
        entry = [s for s in listed if s["sensor_id"] == "stops,site=roof"][0]
        self.assertEqual(entry["readings_accepted"], 2)
        # last_seen (milliseconds, truncated) is when the daemon accepted the readings: after the
        # send began, and before the page that lists them came back (the daemon reads the
        # datagram some time after sendto returns: 8 ms later once under qemu).
        seen = parse_time(entry["last_seen"])
        self.assertGreaterEqual(seen, int(t_before * 1000) / 1000.0 - 0.001)
        self.assertLessEqual(seen, t_listed + 0.001)
        self.assertGreaterEqual(t_after, t_before)

        # Poll ?silent=1s: an answer that came back less than a second after the send
        # started cannot list it (the daemon accepted the readings after t_before).
        early_answers = 0
        deadline = time.monotonic() + DEADLINE
        while True:
            status, page, _ = sensors_page(port, "silent=1s")
            t_done = time.time()
            self.assertEqual(status, 200, page)
            ids = [s["sensor_id"] for s in page["sensors"]]
            if "stops,site=roof" in ids:
                self.assertGreater(t_done, t_before + 1.0,
                                   "listed as silent for 1s %.3fs after it was sent"
                                   % (t_done - t_before))
                break
            if t_done < t_before + 1.0:
                early_answers += 1
            self.assertLess(time.monotonic(), deadline, "never listed under ?silent=1s")
            time.sleep(0.05)
        # A longer silence does not list it yet: its last reading is seconds old, not an hour.
        status, page, _ = sensors_page(port, "silent=1h")
        self.assertEqual((status, page["sensors"]), (200, []))
        # It sends again: no longer silent (while the next second has not passed).
        t_before = time.time()
        udp_send(d.addr("udp"), [b"stops,site=roof v=3"])
        bdtest.wait_for(lambda: [s for s in all_sensors(port)
                                 if s["readings_accepted"] == 3], DEADLINE)
        status, page, _ = sensors_page(port, "silent=1s")
        if time.time() < t_before + 1.0:
            self.assertNotIn("stops,site=roof", [s["sensor_id"] for s in page["sensors"]])
        sys.stderr.write("(%d answers before the second was up) " % early_answers)

    # -- paging ------------------------------------------------------------------------------
    def test_paging_lists_every_sensor_exactly_once_while_sensors_arrive(self):
        d, _, _ = self.sensors_daemon()
        port = d.metrics_port
        sent = {}
        lines = []
        for i in range(230):
            n = 1 + i % 3
            sent["page,id=s%03d" % i] = n
            lines += [b"page,id=s%03d v=%d" % (i, k) for k in range(n)]
        tcp_send(d.addr("tcp"), lines)
        self.wait_listed(port, sent)

        listed, after, pages, late = [], None, 0, []
        while True:
            q = "limit=17" + ("&after=" + urllib.parse.quote(after) if after else "")
            status, page, _ = sensors_page(port, q)
            self.assertEqual(status, 200, page)
            self.assertLessEqual(len(page["sensors"]), 17)
            listed += page["sensors"]
            pages += 1
            if pages == 3:
                # New sensors between pages: they come after everything listed so far.
                late = ["page,id=late%d" % i for i in range(5)]
                tcp_send(d.addr("tcp"), [s.encode() + b" v=1" for s in late])
                self.wait_listed(port, late)
            after = page["next"]
            if after is None:
                break
            self.assertLess(pages, 100)
        ids = [s["sensor_id"] for s in listed]
        for sid, n in sent.items():
            self.assertEqual(ids.count(sid), 1, sid)
            self.assertEqual([s for s in listed if s["sensor_id"] == sid][0]
                             ["readings_accepted"], n, sid)
        for sid in late:
            self.assertEqual(ids.count(sid), 1, sid)
        self.assertEqual(len(ids), len(sent) + len(late), "nothing else, nothing twice")
        times = [parse_time(s["last_seen"]) for s in listed]
        self.assertEqual(times, sorted(times), "oldest first across pages")
        self.assertGreaterEqual(pages, (len(sent) + len(late)) // 17)

    # -- hostile ids -------------------------------------------------------------------------
    def test_hostile_ids_are_escaped_into_valid_json(self):
        d, _, _ = self.sensors_daemon()
        port = d.metrics_port
        hostile = ['h,id=q"uote', 'h,id=back\\\\slash', "h,id=ev\u009b2J\u009b31m\u0085FORGED",
                   "h,id=rlo\u202eab", 'g"q\\b.ok.v']
        udp_send(d.addr("udp"), [s.encode() + b" v=1" for s in hostile[:4]])
        udp_send(d.addr("graphite"), [b'g"q\\b.ok.v 1 %d' % int(time.time())])
        # Refused by the parsers: C0 controls, DEL, invalid UTF-8.
        refused = [b"h,id=ctl\x01\x1bx v=1", b"h,id=del\x7fx v=1", b"h,id=bad\xff\xfe v=1"]
        udp_send(d.addr("udp"), refused)
        udp_send(d.addr("graphite"), [b"c\x01t.v 1 %d" % int(time.time())])
        listed = self.wait_listed(port, hostile)
        _, _, body = sensors_page(port, "")
        for raw in RAW_CONTROLS:
            self.assertNotIn(raw, body, "a raw terminal control in the body")
        self.assertIn(b'"h,id=q\\"uote"', body)
        self.assertIn(b"\\u009b2J\\u009b31m\\u0085FORGED", body)
        self.assertIn(b"rlo\\u202eab", body)
        self.assertEqual(sorted(s["sensor_id"] for s in listed), sorted(hostile),
                         "what was sent, and none of the refused ids")
        dropped = bdtest.wait_for(lambda: dropped_total(port) >= 4, DEADLINE)
        self.assertTrue(dropped, "the four refused lines were not counted")

    # -- bounds ------------------------------------------------------------------------------
    def test_limits_and_bad_parameters_answer_400_with_a_reason(self):
        d, _, _ = self.sensors_daemon()
        port = d.metrics_port
        udp_send(d.addr("udp"), [b"lim,id=%d v=1" % i for i in range(3)])
        self.wait_listed(port, ["lim,id=%d" % i for i in range(3)])
        bad = {
            "limit=0": "limit", "limit=1001": "limit", "limit=-5": "limit", "limit=ten": "limit",
            "limit=": "limit", "silent=5": "silent", "silent=soon": "silent",
            "silent=1s&silent=2s": "silent", "after=xyz": "after", "after=1-": "after",
            "sort=id": "sort", "silent=%zz": "silent",
        }
        for q, word in bad.items():
            status, page, _ = sensors_page(port, q)
            self.assertEqual(status, 400, q)
            self.assertIn(word, page["error"], q)
        status, page, _ = sensors_page(port, "limit=1000")
        self.assertEqual((status, len(page["sensors"]), page["next"]), (200, 3, None))
        status, page, _ = sensors_page(port, "limit=1")
        self.assertEqual((status, len(page["sensors"])), (200, 1))
        self.assertIsNotNone(page["next"])
        status, page2, _ = sensors_page(port, "limit=2&after=" + page["next"])
        self.assertEqual((status, len(page2["sensors"]), page2["next"]), (200, 2, None))
        self.assertNotIn(page["sensors"][0]["sensor_id"],
                         [s["sensor_id"] for s in page2["sensors"]])
        # Default page size: 100 of 130.
        udp_send(d.addr("udp"), [b"lim,id=x%d v=1" % i for i in range(127)])
        bdtest.wait_for(lambda: len(all_sensors(port)) == 130, DEADLINE)
        status, page, _ = sensors_page(port, "")
        self.assertEqual((status, len(page["sensors"])), (200, 100))
        self.assertIsNotNone(page["next"])
        # HEAD: the headers alone; other methods 405.
        status, headers, body = http_get(port, "/sensors", method="HEAD")
        self.assertEqual((status, body), (200, b""))
        status, _, _ = http_get(port, "/sensors", method="POST")
        self.assertEqual(status, 405)
        self.assertTrue(d.alive())

    # -- the gauge ---------------------------------------------------------------------------
    def test_gauge_counts_silent_sensors_and_follows_reload(self):
        d, _, _ = self.sensors_daemon()
        port = d.metrics_port
        t_before = time.time()
        udp_send(d.addr("udp"), [b"gauge,id=%d v=1" % i for i in range(3)])
        self.wait_listed(port, ["gauge,id=%d" % i for i in range(3)])
        v = scrape_value(port, "bucketd_sensors_silent")
        if time.time() < t_before + 1.0:
            self.assertEqual(v, 0, "silent before metrics.silent_after passed")
        got = bdtest.wait_for(lambda: scrape_value(port, "bucketd_sensors_silent") == 3,
                              DEADLINE)
        self.assertTrue(got, "bucketd_sensors_silent never reached 3")
        self.assertEqual(len(all_sensors(port, "silent=1s")), 3)
        # A reload to an hour: none of them has been silent that long.
        d.config["metrics"]["silent_after"] = "1h"
        d.reload()
        self.assertEqual(scrape_value(port, "bucketd_sensors_silent"), 0)
        # 0: the gauge is gone (and /sensors still answers).
        d.config["metrics"]["silent_after"] = "0"
        d.reload()
        self.assertIsNone(scrape_value(port, "bucketd_sensors_silent"))
        self.assertEqual(len(all_sensors(port)), 3)

    # -- bucketd-inspect sensors -------------------------------------------------------------
    def test_inspect_sensors_silent_reads_the_summaries_a_daemon_wrote(self):
        d, client, db = self.sensors_daemon(extra={"summaries": {"interval": "1s"}})
        now_ns = time.time_ns()
        old_ns = now_ns - 3 * 3600 * bdtest.NS_PER_S
        tcp_send(d.addr("tcp"), [b"insp,id=old v=1 %d" % old_ns,
                                 b"insp,id=old v=2 %d" % (old_ns + bdtest.NS_PER_S),
                                 b"insp,id=fresh v=1 %d" % now_ns])
        coll = client[db]["buckets_summary"]
        ok = bdtest.wait_for(lambda: coll.count_documents({}) == 2, DEADLINE)
        self.assertTrue(ok, "the daemon wrote no summaries\n" + bdtest.log_tail(d.log(), 30))

        def inspect(*args):
            p = subprocess.run([INSPECT, "--uri", d.config["mongodb"]["uri"], "--database", db]
                               + list(args), stdin=subprocess.DEVNULL, capture_output=True,
                               timeout=60)
            return p.returncode, p.stdout.decode(), p.stderr.decode()

        rc, out, err = inspect("sensors", "--silent", "90m")
        self.assertEqual(rc, 0, err)
        lines = out.splitlines()
        self.assertEqual(len(lines), 2, out)
        self.assertTrue(lines[0].endswith(" insp,id=old"), out)
        self.assertTrue(lines[1].startswith("1 sensors whose newest bucket ended before"), out)
        # The old bucket's bounds, from the readings' time (hour buckets).
        hour_s = (old_ns // bdtest.NS_PER_S) // 3600 * 3600
        start = datetime.datetime.fromtimestamp(hour_s, datetime.timezone.utc)
        self.assertTrue(lines[0].startswith(start.strftime("%Y-%m-%dT%H:%M:%SZ ")), out)

        rc, out, err = inspect("sensors")
        self.assertEqual(rc, 0, err)
        self.assertEqual([line.split()[-1] for line in out.splitlines()[:-1]],
                         ["insp,id=old", "insp,id=fresh"], out)
        self.assertEqual(out.splitlines()[-1], "2 sensors")

        rc, out, err = inspect("sensors", "--silent", "5h")
        self.assertEqual(rc, 0, err)
        self.assertTrue(out.startswith("0 sensors whose newest bucket ended before"), out)

        rc, out, err = inspect("sensors", "--silent", "soon")
        self.assertEqual(rc, 2)
        self.assertIn("--silent", err)


if __name__ == "__main__":
    unittest.main()
