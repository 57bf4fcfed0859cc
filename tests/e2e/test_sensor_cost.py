#!/usr/bin/python3
"""What a sender may cost: sensor names, sensor memory and idle sensors, against the real daemon.

  test_name_flood          200,000 distinct sensor names over UDP while ten known sensors send
                           over TCP: the known ones lose nothing, the daemon's peak RSS stays
                           within limits.memory + limits.sensor_memory (+ its idle size), every
                           flood reading it accepted is stored exactly once, and once the flood's
                           sensors are evicted (limits.sensor_idle) a new sensor is stored.
  test_max_name            a sensor id and a field key one byte over limits.max_name are refused
                           and counted; at the limit they are stored.

Run: /usr/bin/python3 tests/e2e/test_sensor_cost.py   (see bdtest.py for the environment)
"""

import os
import socket
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

FLOOD_SENSORS = 200000
FLOOD_LINES_PER_DATAGRAM = 100
KNOWN = 10
MEMORY = 16 << 20
SENSOR_MEMORY = 4 << 20
# What the daemon allocates beyond its budgets while it works: the driver's bulk write
# buffers and replies, the parser, stacks. Measured about 6 MiB; twice that here.
ALLOWANCE = 12 << 20


def log(msg):
    sys.stderr.write("    [cost] %s\n" % msg)
    sys.stderr.flush()


class KnownSensors:
    """KNOWN sensors, one TCP connection, a reading of each every 20 ms (seq counts them all),
    until stop()."""

    def __init__(self, addr):
        self.sock = socket.create_connection(addr)
        self.sent = []  # (sensor id, seq, ts_ms)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        seq = 0
        while not self._stop.is_set():
            ts_ms = int(time.time() * 1000)
            lines = []
            for k in range(KNOWN):
                sid = "known,id=k%d" % k
                lines.append("%s seq=%di %d\n" % (sid, seq, ts_ms * 1000000))
                self.sent.append((sid, seq, ts_ms))
                seq += 1
            self.sock.sendall("".join(lines).encode())
            self._stop.wait(0.02)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()


class SensorCostTest(bdtest.E2ECase):
    db_prefix = "e2e_cost"

    def test_name_flood(self):
        uri, client, db = self.new_database()
        mport = bdtest.free_port()
        d = self.daemon(uri, db, extra={
            "limits": {"max_sensors": 20000, "memory": "%dMiB" % (MEMORY >> 20),
                       "sensor_memory": "%dMiB" % (SENSOR_MEMORY >> 20), "sensor_idle": "2s"},
            "metrics": {"bind": "127.0.0.1:%d" % mport},
            # Thousands of flood buckets: their summary documents are not this test's subject,
            # and the test server's aggregates over them would take the stop's whole deadline.
            "summaries": {"interval": "0"},
        }).start()
        pid = d.proc.pid
        idle_kib = bdtest.proc_status_kib(pid, "VmRSS")

        known = KnownSensors(d.addr("tcp"))
        self.addCleanup(lambda: known._stop.set())
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.addCleanup(u.close)
        ts_ns = int(time.time()) * 10**9
        t0 = time.monotonic()
        for b in range(0, FLOOD_SENSORS, FLOOD_LINES_PER_DATAGRAM):
            lines = "".join("flood,id=n%07d v=1 %d\n" % (i, ts_ns)
                            for i in range(b, b + FLOOD_LINES_PER_DATAGRAM))
            u.sendto(lines.encode(), d.addr("udp"))
            if b % 5000 == 0:
                time.sleep(0.005)  # pace the sender a little: kernel drops are not the subject
        log("flood of %d names sent in %.1f s" % (FLOOD_SENSORS, time.monotonic() - t0))
        time.sleep(0.5)  # the known sensors go on after the flood (the scenario, not a wait)
        known.stop()

        # Every known reading is stored, exactly once.
        def docs_of_known():
            return list(client[db]["buckets"].find({"sensor_id": {"$regex": "^known,"}}))

        ok = bdtest.wait_for(
            lambda: sum(int(x.get("count", 0)) for x in docs_of_known()) >= len(known.sent), 120)
        stored = {}
        for doc in docs_of_known():
            for r in doc.get("readings") or []:
                key = (doc["sensor_id"], r.get("seq"))
                self.assertNotIn(key, stored, "known reading stored twice: %r" % (key,))
                stored[key] = r
        missing = [(s, q) for s, q, _ in known.sent if (s, q) not in stored]
        self.assertTrue(ok and not missing, "%d of %d known readings missing (first %r)" % (
            len(missing), len(known.sent), missing[:5]))

        # The flood's sensors go (limits.sensor_idle) and a new sensor is taken again.
        self.assertTrue(bdtest.wait_for(
            lambda: (bdtest.metric(mport, "bucketd_sensors") or 0) <= KNOWN, 120),
            "sensors still tracked: %s" % bdtest.metric(mport, "bucketd_sensors"))
        for i in range(3):
            u.sendto(b"after,id=legit v=%di %d\n" % (i, time.time_ns()), d.addr("udp"))
        self.assertTrue(bdtest.wait_for(
            lambda: sum(int(x.get("count", 0)) for x in
                        client[db]["buckets"].find({"sensor_id": "after,id=legit"})) == 3, 60),
            "the sensor sent after the flood was not stored")

        hwm_kib = bdtest.proc_status_kib(pid, "VmHWM")
        why = bdtest.rss_not_applicable(pid)
        d.stop(timeout=120)
        st = d.require_stats()
        log("stats: accepted %d, drop_sensor_limit %d, drop_sensor_memory %d, drop_sensor_busy "
            "%d, sensors_evicted %d; idle RSS %d KiB, peak %d KiB" % (
                st["readings_accepted"], st["drop_sensor_limit"], st["drop_sensor_memory"],
                st["drop_sensor_busy"], st["sensors_evicted"], idle_kib, hwm_kib))
        refused = st["drop_sensor_limit"] + st["drop_sensor_memory"] + st["drop_sensor_busy"]
        self.assertGreater(refused, 0, "the flood never reached a limit: %r" % st)
        self.assertGreater(st["sensors_evicted"], 0, st)
        self.assertStat(st, "readings_lost", 0, d)
        self.assertStat(st, "drop_buffer_full", 0, d)
        # Every reading accepted (known, flood, the one after) is stored exactly once.
        self.assertEqual(bdtest.stored_count(client, db), st["readings_accepted"])
        flood = sum(int(x.get("count", 0)) for x in
                    client[db]["buckets"].find({"sensor_id": {"$regex": "^flood,"}}))
        self.assertEqual(flood + len(known.sent) + 3, st["readings_accepted"])
        self.assertGreaterEqual(
            st["udp_socket_drops"] + st["drop_sensor_limit"] + st["drop_sensor_memory"] +
            st["drop_sensor_busy"] + flood, FLOOD_SENSORS,
            "flood readings neither stored nor counted: %r" % st)

        if why:
            log("RSS bound not checked: %s" % why)
            return
        bound_kib = (MEMORY + SENSOR_MEMORY + ALLOWANCE) // 1024 + idle_kib
        self.assertLessEqual(hwm_kib, bound_kib,
                             "peak RSS %d KiB above limits.memory %d KiB + sensor_memory %d KiB "
                             "+ allowance %d KiB + idle %d KiB" % (
                                 hwm_kib, MEMORY >> 10, SENSOR_MEMORY >> 10, ALLOWANCE >> 10,
                                 idle_kib))

    def test_max_name(self):
        uri, client, db = self.new_database()
        d = self.daemon(uri, db, extra={"limits": {"max_name": "64"}}).start()
        ok_id = "m,t=" + "a" * 60           # 64 bytes
        long_id = "m,t=" + "b" * 61         # 65 bytes
        ok_key = "k" * 64
        long_key = "f" * 65
        lines = ["%s v=1i" % ok_id, "%s v=2i" % long_id, "m,t=c %s=3i" % ok_key,
                 "m,t=d %s=4i" % long_key]
        s = socket.create_connection(d.addr("tcp"))
        s.sendall(("\n".join(lines) + "\n").encode())
        s.close()
        self.assertEqual(bdtest.wait_stored(client, db, 2, 30), 2)
        d.stop()
        st = d.require_stats()
        self.assertStat(st, "drop_name_too_long", 2, d)
        self.assertStat(st, "readings_accepted", 2, d)
        ids = sorted(x["sensor_id"] for x in client[db]["buckets"].find({}))
        self.assertEqual(ids, sorted([ok_id, "m,t=c"]))


if __name__ == "__main__":
    unittest.main()
