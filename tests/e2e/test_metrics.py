"""End-to-end: /metrics and /healthz of the real daemon (src/metrics.c, src/http.c).

- a scrape's counters equal what the test sent, and `promtool check metrics` (Debian's
  prometheus package) accepts a real scrape;
- hostile HTTP (oversized heads, endless header lines, a slowloris, more connections than the
  server takes, unknown paths and methods, garbage) is answered 431/408/503/404/405/400 within
  its bounds while readings keep arriving over UDP and TCP, and every one of them is stored;
- /healthz answers 200 while writes succeed, 503 with the reason once MongoDB has been
  unreachable longer than metrics.unhealthy_after (a fault proxy refusing connections) or the
  spool is past its high-water mark, and 200 again once MongoDB is back and the spool replayed;
  a corrupt spool record found at replay makes it 503 with that reason.

Run: /usr/bin/python3 tests/e2e/test_metrics.py   (see bdtest.py for the environment)
"""

import glob
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402
from bdtest import send_readings as sr  # noqa: E402

STORE_DEADLINE = 120.0

# The server's bounds (bd_http_default_limits).
MAX_CONNECTIONS = 32
MAX_HEAD = 8192
HEAD_TIMEOUT_S = 5.0


http_get = bdtest.http_get
scrape = bdtest.scrape


def health(port):
    status, headers, body = http_get(port, "/healthz")
    assert headers["Content-Type"] == "application/json", headers
    assert body.endswith(b"\n") and body.count(b"\n") == 1, body
    return status, json.loads(body)


def raw_exchange(port, data, timeout=10.0, read=True):
    """Send data on a new connection; returns what came back until the server closed (or
    b"" after a reset)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        if data:
            s.sendall(data)
        if not read:
            return s
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        if read:
            s.close()


def status_of(response):
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", response)
    return int(m.group(1)) if m else None


def last_hour_readings(sensors, per_sensor, seed, seq_base=0):
    """Readings of sensors 0..sensors-1, all in the previous whole hour: one bucket each, so
    that once a first batch has been written, later ones have every page known and can go to
    the spool while MongoDB is away (a bucket of unknown pages waits in memory instead)."""
    hour_ns = 3600 * bdtest.NS_PER_S
    start = time.time_ns() // hour_ns * hour_ns - hour_ns
    return sr.make_readings(sensors=sensors, per_sensor=per_sensor, seed=seed,
                            seq_base=seq_base, start_ns=start + bdtest.NS_PER_S,
                            span_ns=hour_ns - 60 * bdtest.NS_PER_S)


class Trickle(threading.Thread):
    """Sends readings over UDP and TCP at a steady pace until stopped (in another thread, so
    that hostile clients and ingestion overlap)."""

    def __init__(self, daemon, readings, per_round=20, pause=0.02):
        super().__init__(daemon=True)
        self.d = daemon
        self.readings = readings
        self.per_round = per_round
        self.pause = pause
        self.sent = 0
        self.error = None

    def run(self):
        try:
            with sr.Sender(udp=self.d.addr("udp"), tcp=self.d.addr("tcp"),
                           lines_per_datagram=4) as s:
                for i, r in enumerate(self.readings):
                    s.send_reading(r)
                    self.sent += 1
                    if i % self.per_round == self.per_round - 1:
                        s.flush()
                        time.sleep(self.pause)
                s.flush()
        except Exception as e:  # reported by the test
            self.error = e


class Metrics(bdtest.E2ECase):
    db_prefix = "e2e_metrics"

    def metrics_daemon(self, uri, db, name="d", extra=None, **kw):
        port = bdtest.free_port()
        cfg = {"metrics": {"bind": "127.0.0.1:%d" % port}}
        d = self.daemon(uri, db, name=name, extra=bdtest.deep_merge(cfg, extra or {}), **kw)
        d.metrics_port = port
        return d

    def assertStored(self, client, db, n, daemon):
        stored = bdtest.wait_stored(client, db, n, STORE_DEADLINE)
        if stored != n:
            self.fail("the documents hold %d readings, %d were sent\n--- log tail ---\n%s" % (
                stored, n, bdtest.log_tail(daemon.log(), 30)))

    # -- counters ----------------------------------------------------------------------------
    def test_scrape_counts_what_was_sent(self):
        uri, client, db = self.new_database()
        d = self.metrics_daemon(uri, db)
        d.start()
        readings = sr.make_readings(sensors=20, per_sensor=50, seed=31)
        summary = sr.send(readings, udp=d.addr("udp"), tcp=d.addr("tcp"), lines_per_datagram=5)
        bad = [b"not a line protocol line", b"m,t=1 f= 1"]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            for line in bad:
                u.sendto(line + b"\n", d.addr("udp"))
        self.assertStored(client, db, len(readings), d)

        def flushed():
            _, s = scrape(d.metrics_port)
            return s if s[("bucketd_readings_flushed_total", "")] == len(readings) else None
        samples = bdtest.wait_for(flushed, 30)
        self.assertTrue(samples, "readings_flushed never reached %d" % len(readings))
        want = {
            "bucketd_udp_datagrams_total": summary["datagrams"] + len(bad),
            "bucketd_udp_bytes_total": summary["udp"]["bytes"] + sum(len(b) + 1 for b in bad),
            "bucketd_tcp_connections_total": 1,
            "bucketd_tcp_bytes_total": summary["tcp"]["bytes"],
            "bucketd_lines_total": len(readings) + len(bad),
            "bucketd_readings_accepted_total": len(readings),
            "bucketd_readings_flushed_total": len(readings),
            "bucketd_sensors": 20,
            "bucketd_mongodb_reachable": 1,
            "bucketd_healthy": 1,
            "bucketd_readings_lost_total": 0,
        }
        for name, value in want.items():
            self.assertEqual(samples[(name, "")], value, name)
        self.assertEqual(samples[("bucketd_dropped_total", '{reason="parse_error"}')], len(bad))
        self.assertEqual(samples[("bucketd_dropped_total", '{reason="too_old"}')], 0)
        # Histograms: one latency per bulk write attempt, one readings count per update sent;
        # unless an attempt failed, every update was sent once and the readings add up to
        # those flushed.
        self.assertEqual(samples[("bucketd_update_readings_count", "")],
                         samples[("bucketd_updates_sent_total", "")])
        self.assertGreaterEqual(samples[("bucketd_bulk_write_duration_seconds_count", "")],
                                samples[("bucketd_bulk_writes_total", "")])
        self.assertGreaterEqual(samples[("bucketd_update_readings_sum", "")], len(readings))
        if samples[("bucketd_bulk_retries_total", "")] == 0:
            self.assertEqual(samples[("bucketd_bulk_write_duration_seconds_count", "")],
                             samples[("bucketd_bulk_writes_total", "")])
            self.assertEqual(samples[("bucketd_update_readings_sum", "")], len(readings))
        self.assertEqual(samples[("bucketd_update_readings_bucket", '{le="+Inf"}')],
                         samples[("bucketd_update_readings_count", "")])
        self.assertLess(samples[("bucketd_seconds_since_last_successful_write", "")], 30)
        self.assertGreater(samples[("bucketd_last_successful_write_timestamp_seconds", "")],
                           time.time() - 60)
        tcp_bind = '{proto="tcp",bind="127.0.0.1:%d"}' % d.addr("tcp")[1]
        self.assertEqual(samples[("bucketd_listener_connections", tcp_bind)], 0)
        # HEAD: the headers of the GET, no body.
        status, headers, body = http_get(d.metrics_port, "/metrics", method="HEAD")
        self.assertEqual((status, body), (200, b""))
        self.assertGreater(int(headers["Content-Length"]), 5000)
        # The stats line at the stop agrees with the last scrape.
        stats = d.stop()
        for name in ("udp_datagrams", "lines", "readings_accepted", "readings_flushed",
                     "drop_parse_error"):
            metric = ("bucketd_dropped_total", '{reason="parse_error"}') if name.startswith(
                "drop_") else ("bucketd_%s_total" % name, "")
            self.assertEqual(stats[name], samples[metric], name)

    def test_promtool_accepts_a_real_scrape(self):
        promtool = shutil.which("promtool")
        if promtool is None:
            self.skipTest("promtool not installed (Debian package prometheus; "
                          "tools/install-deps.sh installs it)")
        uri, client, db = self.new_database()
        d = self.metrics_daemon(uri, db)
        d.start()
        readings = sr.make_readings(sensors=5, per_sensor=40, seed=32)
        sr.send(readings, udp=d.addr("udp"), tcp=d.addr("tcp"))
        self.assertStored(client, db, len(readings), d)
        text, _ = scrape(d.metrics_port)
        p = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                           capture_output=True, timeout=60)
        self.assertEqual(p.returncode, 0, "promtool check metrics:\n%s%s" % (
            p.stdout.decode(), p.stderr.decode()))

    # -- hostile HTTP ------------------------------------------------------------------------
    def test_hostile_http_is_bounded_and_ingestion_goes_on(self):
        uri, client, db = self.new_database()
        d = self.metrics_daemon(uri, db)
        d.start()
        port = d.metrics_port
        readings = sr.make_readings(sensors=40, per_sensor=150, seed=33)
        trickle = Trickle(d, readings)
        trickle.start()
        held = []
        try:
            # Unknown path, unknown method, a request line that is not HTTP.
            self.assertEqual(http_get(port, "/nope")[0], 404)
            self.assertEqual(http_get(port, "/metrics", method="POST")[0], 405)
            self.assertEqual(http_get(port, "/healthz", method="DELETE")[0], 405)
            self.assertEqual(status_of(raw_exchange(port, b"\x16\x03\x01garbage\r\n\r\n")), 400)
            self.assertEqual(status_of(raw_exchange(port, b"GET /metrics SPDY/3\r\n\r\n")), 400)
            # An oversized head in one go, and header lines that never end: 431.
            big = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (4 * MAX_HEAD) + b"\r\n\r\n"
            self.assertEqual(status_of(raw_exchange(port, big)), 431)
            s = raw_exchange(port, b"GET /metrics HTTP/1.1\r\n", read=False)
            answer = b""
            try:
                for i in range(10000):
                    s.sendall(b"X-Endless-%d: yes\r\n" % i)
            except (BrokenPipeError, ConnectionResetError):
                pass
            try:
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
            except ConnectionResetError:
                pass
            s.close()
            self.assertIn(status_of(answer), (431, None))
            # A slowloris: a head that trickles in one byte a second is cut off at the head
            # deadline with 408, whatever it still sends.
            s = raw_exchange(port, b"GET /metrics HTTP/1.1\r\n", read=False)
            t0 = time.monotonic()
            answer = b""
            s.settimeout(0.5)
            while time.monotonic() - t0 < HEAD_TIMEOUT_S + 5:
                try:
                    s.sendall(b"X")
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
                except socket.timeout:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
            waited = time.monotonic() - t0
            s.close()
            self.assertEqual(status_of(answer), 408, answer[:100])
            self.assertLess(waited, HEAD_TIMEOUT_S + 3)
            # More connections than the server takes: the first MAX_CONNECTIONS are held open
            # without a word; the next ones are answered 503 and closed at once (read without
            # sending: a request still unread when the server closes could turn its close into
            # a reset), and one with a request gets 503 or a reset.
            for _ in range(MAX_CONNECTIONS):
                held.append(raw_exchange(port, b"", read=False))
            time.sleep(0.3)
            refused = [raw_exchange(port, b"") for _ in range(5)]
            for answer in refused:
                self.assertEqual(status_of(answer), 503, answer[:100])
            answer = raw_exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")
            self.assertIn(status_of(answer), (503, None), answer[:100])
            # The held connections time out (408) and the server answers again.
            for s in held:
                s.settimeout(HEAD_TIMEOUT_S + 5)
                self.assertEqual(status_of(s.recv(4096)), 408)
                s.close()
            held = []
            # Closed on both sides soon after (the server lingers until the client closes).
            self.assertTrue(bdtest.wait_for(
                lambda: scrape(port)[1][("bucketd_http_connections_open", "")] <= 1, 10))
            text, samples = scrape(port)
            self.assertGreaterEqual(
                samples[("bucketd_http_connections_rejected_total", "")], 5)
            self.assertGreaterEqual(samples[("bucketd_http_responses_total", '{code="408"}')],
                                    MAX_CONNECTIONS + 1)
            self.assertGreaterEqual(samples[("bucketd_http_responses_total", '{code="431"}')], 1)
            self.assertGreaterEqual(samples[("bucketd_http_responses_total", '{code="404"}')], 1)
            self.assertGreaterEqual(samples[("bucketd_http_responses_total", '{code="405"}')], 2)
        finally:
            for s in held:
                s.close()
            trickle.join(120)
        self.assertIsNone(trickle.error)
        self.assertEqual(trickle.sent, len(readings))
        # Every reading sent meanwhile is stored, exactly once.
        self.assertStored(client, db, len(readings), d)
        stats = d.stop()
        self.assertStat(stats, "readings_accepted", len(readings), d)
        docs = self.documents(client, db)
        self.assertNoProblems(bdtest.check_readings(docs, readings, 3600), "readings", d)

    # -- health ------------------------------------------------------------------------------
    def test_healthz_follows_mongodb(self):
        uri, client, db = self.new_database()
        proxy, proxied = bdtest.start_fault_proxy(self, uri, client)
        d = self.metrics_daemon(proxied, db, extra={
            "metrics": {"unhealthy_after": "2s"},
            "flush": {"retry_initial": "100ms", "retry_max": "500ms"},
        })
        d.start()
        port = d.metrics_port
        first = sr.make_readings(sensors=4, per_sensor=50, seed=34)
        sr.send(first, udp=d.addr("udp"), tcp=d.addr("tcp"))
        self.assertStored(client, db, len(first), d)
        # The documents can be stored before the daemon has read MongoDB's reply: wait for the
        # daemon to record the acknowledged write.
        written = bdtest.wait_for(
            lambda: health(port)[1].get("seconds_since_last_write") is not None, 60,
            interval=0.1)
        self.assertTrue(written, "no acknowledged write recorded: %r" % (health(port),))
        status, body = health(port)
        self.assertEqual(status, 200, body)
        self.assertEqual(body["status"], "ok")
        self.assertTrue(body["mongodb_reachable"])

        # MongoDB goes away while readings keep coming.
        proxy.set_fault("refuse")
        second = sr.make_readings(sensors=4, per_sensor=50, seed=35, seq_base=len(first),
                                  sensor_base=4)
        sr.send(second, udp=d.addr("udp"), tcp=d.addr("tcp"))

        def unhealthy():
            st, b = health(port)
            return (st, b) if st == 503 else None
        got = bdtest.wait_for(unhealthy, 60, interval=0.2)
        self.assertTrue(got, "no 503 within 60 s\n%s" % bdtest.log_tail(d.log(), 30))
        st, b = got
        self.assertEqual(b["status"], "unhealthy")
        self.assertFalse(b["mongodb_reachable"])
        self.assertTrue(any("MongoDB unreachable for" in r for r in b["reasons"]), b)
        _, samples = scrape(port)
        self.assertEqual(samples[("bucketd_healthy", "")], 0)
        self.assertEqual(samples[("bucketd_mongodb_reachable", "")], 0)
        self.assertGreater(samples[("bucketd_mongodb_unreachable_seconds", "")], 2)

        # Back: 200 again, and nothing was lost.
        proxy.set_fault("pass")
        ok = bdtest.wait_for(lambda: health(port)[0] == 200, 60, interval=0.2)
        self.assertTrue(ok, "still 503: %r" % (health(port),))
        self.assertStored(client, db, len(first) + len(second), d)
        self.assertTrue(health(port)[1]["mongodb_reachable"])
        d.stop()

    def test_healthz_spool_high_water(self):
        """Readings spooled during an outage past metrics.spool_high_water percent of
        spool.max_bytes: 503 with that reason until the spool is replayed."""
        uri, client, db = self.new_database()
        proxy, proxied = bdtest.start_fault_proxy(self, uri, client)
        d = self.metrics_daemon(proxied, db, extra={
            # 1% of 1 MiB: about 10 KB, a few hundred readings.
            "metrics": {"unhealthy_after": "10m", "spool_high_water": 1},
            "spool": {"max_bytes": "1MiB"},
            "flush": {"retry_initial": "100ms", "retry_max": "500ms"},
        })
        d.start()
        port = d.metrics_port
        first = last_hour_readings(20, 2, seed=36)
        sr.send(first, udp=d.addr("udp"), tcp=d.addr("tcp"))
        self.assertStored(client, db, len(first), d)
        proxy.set_fault("refuse")
        more = []
        for k in range(5):
            batch = last_hour_readings(20, 50, seed=40 + k, seq_base=len(first) + len(more))
            sr.send(batch, udp=d.addr("udp"), tcp=d.addr("tcp"))
            more += batch
            time.sleep(0.5)

        def spool_reason():
            st, b = health(port)
            return b if st == 503 and any("high-water" in r for r in b["reasons"]) else None
        b = bdtest.wait_for(spool_reason, 60, interval=0.2)
        self.assertTrue(b, "no spool 503: %r\n%s" % (health(port), bdtest.log_tail(d.log())))
        self.assertGreater(b["spool_bytes"], b["spool_high_water_bytes"])
        self.assertEqual(b["spool_high_water_bytes"], 1048576 // 100)
        proxy.set_fault("pass")
        self.assertStored(client, db, len(first) + len(more), d)
        ok = bdtest.wait_for(lambda: health(port)[0] == 200, 60, interval=0.2)
        self.assertTrue(ok, "still 503 after the replay: %r" % (health(port),))
        stats = d.stop()
        self.assertGreater(stats["readings_spooled"], 0)

    def test_healthz_corrupt_spool_record(self):
        """A spooled record whose checksum fails at replay: skipped, counted, and 503."""
        uri, client, db = self.new_database()
        spool = os.path.join(self.workdir, "spool")
        # 1: a first batch written, then MongoDB away; the stop puts the rest on the spool.
        proxy, proxied = bdtest.start_fault_proxy(self, uri, client)
        d1 = self.metrics_daemon(proxied, db, name="d1", extra={
            "spool": {"dir": spool}, "flush": {"stop_timeout": "1s"}})
        d1.start()
        first = last_hour_readings(3, 2, seed=38)
        sr.send(first, udp=d1.addr("udp"), tcp=d1.addr("tcp"))
        self.assertStored(client, db, len(first), d1)
        # Stored is not yet acknowledged: a fault while the reply is on its way makes the daemon
        # spool the batch as maybe applied (replayed once, found applied), which would count
        # those readings as spooled too.
        self.assertTrue(bdtest.wait_for(
            lambda: scrape(d1.metrics_port)[1][("bucketd_readings_flushed_total", "")] ==
            len(first), 30), "the first batch was never acknowledged")
        proxy.set_fault("refuse")
        # Two sends a few flush intervals apart: at least two records, since damage in the
        # last record of the newest segment reads as a torn write (cut off), not as corruption.
        readings = last_hour_readings(3, 20, seed=37, seq_base=len(first))
        sr.send(readings[:30], udp=d1.addr("udp"), tcp=d1.addr("tcp"))
        time.sleep(2)
        sr.send(readings[30:], udp=d1.addr("udp"), tcp=d1.addr("tcp"))
        time.sleep(2)
        self.assertTrue(bdtest.wait_for(
            lambda: scrape(d1.metrics_port)[1][("bucketd_readings_accepted_total", "")] ==
            len(first) + len(readings), 30))
        stats = d1.stop()
        self.assertEqual(stats["readings_spooled"], len(readings))
        # Flip a byte in the first record's payload (after the 32-byte segment header and the
        # 32-byte record header): its record checksum fails, its header checksum holds.
        segs = sorted(glob.glob(os.path.join(spool, "spool-*.seg")))
        self.assertTrue(segs)
        with open(segs[0], "r+b") as f:
            data = f.read()
            records, off = 0, 32
            while off + 32 <= len(data):
                (n,) = struct.unpack_from("<I", data, off + 4)
                off += 32 + n
                records += 1
            self.assertGreaterEqual(records, 2, "records in %s" % segs[0])
            f.seek(32 + 4)
            (length,) = struct.unpack("<I", f.read(4))
            self.assertGreater(length, 16)
            f.seek(32 + 32 + length // 2)
            b = f.read(1)
            f.seek(32 + 32 + length // 2)
            f.write(bytes([b[0] ^ 0xFF]))
        # 2: MongoDB reachable, same spool.
        d2 = self.metrics_daemon(uri, db, name="d2", extra={"spool": {"dir": spool},
                                                            "writer_id": d1.config["writer_id"]})
        d2.start()

        def corrupt():
            st, b = health(d2.metrics_port)
            return b if st == 503 and b["spool_corrupt_records"] > 0 else None
        b = bdtest.wait_for(corrupt, 30, interval=0.2)
        self.assertTrue(b, "no 503: %r\n%s" % (health(d2.metrics_port),
                                                 bdtest.log_tail(d2.log())))
        self.assertTrue(any("corrupt spool records" in r for r in b["reasons"]), b)
        _, samples = scrape(d2.metrics_port)
        self.assertGreaterEqual(samples[("bucketd_spool_corrupt_records_total", "")], 1)
        self.assertEqual(samples[("bucketd_healthy", "")], 0)
        d2.stop()


if __name__ == "__main__":
    unittest.main()
