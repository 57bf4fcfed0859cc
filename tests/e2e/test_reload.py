#!/usr/bin/python3
"""Reload on SIGHUP (bucketd.yaml(5) "RELOAD") and retention (bucketd-schema(7) "Retention"), end to end.

- Under load over UDP and TCP, several reloads (flush.interval, log.level, a listener added, a
  listener removed): every reading sent to a listener that existed is stored exactly once; of
  the readings sent to the UDP listener being removed, those sent before the reload are stored
  exactly once, and the test says how many sent after it were lost.
- A file that does not validate changes nothing and its file:line:col error is logged; a key
  that needs a restart is named and keeps its value; systemd hears RELOADING=1 (with
  MONOTONIC_USEC) and then READY=1, through a NOTIFY_SOCKET the test reads.
- buckets.retention and summaries.retention keep the TTL index bucket_end_ttl: created at
  start, changed in place by a reload (collMod), dropped when set to 0; an index of the
  operator on {bucket_end: 1} is left alone and reported.

Every wait is on a log line, the notify socket or stored readings, with a generous deadline
that is never asserted as a duration. Run time: about 4 s against the test server (5 s
under ASan or TSan).

Run: /usr/bin/python3 tests/e2e/test_reload.py   (see bdtest.py for the environment; with
BUCKETD_TEST_MONGODB_URI the same tests run against a real MongoDB)
"""

import os
import re
import signal
import socket
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402
from bdtest import send_readings as sr  # noqa: E402

SPAN_S = 3600
DEADLINE = 60.0  # bound on every wait (seconds), never asserted as a duration
NS_PER_S = 1_000_000_000


def ttl_of(client, database, collection):
    """expireAfterSeconds of bucketd's TTL index on a collection, or None without one."""
    for ix in client[database][collection].list_indexes():
        if ix["name"] == "bucket_end_ttl":
            return ix.get("expireAfterSeconds")
    return None


class NotifySocket:
    """The NOTIFY_SOCKET of a Type=notify unit: collects what the daemon tells systemd."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages = []

    def next(self, timeout=DEADLINE):
        """The next message as a dict, or None after timeout."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except socket.timeout:
            return None
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append(fields)
        return fields

    def close(self):
        self.sock.close()


class Load(threading.Thread):
    """Sends readings one by one (paced) over one UDP socket or one TCP connection until told
    to stop or out of readings; remembers when each was sent (monotonic ns)."""

    def __init__(self, readings, udp=None, tcp=None, pace_s=0.002):
        threading.Thread.__init__(self, daemon=True)
        self.readings = readings
        self.sender = sr.Sender(udp=udp, tcp=tcp, pace_every=0)
        self.pace_s = pace_s
        self.sent_at = []
        self.stop_event = threading.Event()
        self.error = None

    def run(self):
        try:
            for r in self.readings:
                if self.stop_event.is_set():
                    break
                self.sender.send_reading(r)
                self.sender.flush()
                self.sent_at.append(time.monotonic_ns())
                time.sleep(self.pace_s)
        except Exception as e:  # reported by finish()
            self.error = e
        finally:
            self.sender.close()

    @property
    def sent(self):
        return self.readings[:len(self.sent_at)]

    def finish(self, case):
        self.stop_event.set()
        self.join(DEADLINE)
        case.assertFalse(self.is_alive(), "a load thread did not end")
        case.assertIsNone(self.error, "sending failed: %r" % self.error)


class Reload(bdtest.E2ECase):
    db_prefix = "reload"

    def start_notifying(self):
        """A daemon that tells its NOTIFY_SOCKET, started (READY=1 heard): client, db, ns, d."""
        uri, client, db = self.new_database()
        ns = NotifySocket(os.path.join(self.workdir, "notify"))
        self.addCleanup(ns.close)
        d = self.daemon(uri, db, env={"NOTIFY_SOCKET": ns.path})
        d.start()
        self.assertEqual(ns.next().get("READY"), "1")
        return client, db, ns, d

    def wait_log(self, d, text, count=1):
        if not bdtest.wait_for(lambda: d.log().count(text) >= count or not d.alive(), DEADLINE):
            d.fail("no %r (x%d) in the log" % (text, count))

    def send_tcp(self, d, readings, name="tcp"):
        sr.send(readings, tcp=d.addr(name))

    def assertStoredOnce(self, client, db, readings, d):
        stored = bdtest.wait_stored(client, db, len(readings), DEADLINE)
        self.assertEqual(stored, len(readings), "stored readings")
        docs = self.documents(client, db)
        self.assertNoProblems(bdtest.check_readings(docs, readings, SPAN_S), "readings", d)
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, 3600), "documents", d)

    def test_reloads_under_load_store_every_reading_once(self):
        uri, client, db = self.new_database()
        d = self.daemon(uri, db, listeners=[
            {"name": "udp", "proto": "udp"}, {"name": "tcp", "proto": "tcp"},
            {"name": "udp-gone", "proto": "udp"}, {"name": "tcp-gone", "proto": "tcp"}])
        d.start()
        good = d.config

        def readings(base, seq_base):
            rs = sr.make_readings(sensors=3, per_sensor=3000, sensor_base=base,
                                  seq_base=seq_base, seed=base)
            return sorted(rs, key=lambda r: r.ts_ns)  # the sensors take turns

        loads = {
            "udp": Load(readings(0, 0), udp=d.addr("udp")),
            "tcp": Load(readings(10, 100000), tcp=d.addr("tcp")),
            "udp-gone": Load(readings(20, 200000), udp=d.addr("udp-gone")),
            "tcp-gone": Load(readings(30, 300000), tcp=d.addr("tcp-gone")),
        }
        for load in loads.values():
            load.start()
        self.assertTrue(bdtest.wait_for(
            lambda: all(len(l.sent_at) >= 100 for l in loads.values()), DEADLINE))

        d.config = bdtest.deep_merge(good, {"flush": {"interval": "50ms"},
                                            "log": {"level": "debug"}})
        d.reload()

        # The UDP and TCP listeners "-gone" go, one is added.
        new_port = bdtest.free_port("tcp")
        d.config["listeners"] = [l for l in d.config["listeners"]
                                 if not l["bind"].endswith(":%d" % d.addr("udp-gone")[1]) and
                                 not l["bind"].endswith(":%d" % d.addr("tcp-gone")[1])]
        d.config["listeners"].append({"proto": "tcp", "bind": "127.0.0.1:%d" % new_port,
                                      "format": "influx", "precision": "ns"})
        hup_ns = time.monotonic_ns()
        added = d.reload()
        self.assertIn("reload: listener udp 127.0.0.1:%d removed" % d.addr("udp-gone")[1], added)
        self.assertIn("reload: listener tcp 127.0.0.1:%d added" % new_port, added)
        self.assertIn("listening on 127.0.0.1:%d" % new_port, added)
        self.assertRegex(added, r"\(tcp 127\.0\.0\.1:%d\): removed; its 1 open connections "
                                r"stay" % d.addr("tcp-gone")[1])
        loads["udp-gone"].finish(self)  # it sent to a closed port for a while: counted below
        loads["tcp-new"] = Load(readings(40, 400000), tcp=("127.0.0.1", new_port))
        loads["tcp-new"].start()
        self.assertTrue(bdtest.wait_for(lambda: len(loads["tcp-new"].sent_at) >= 100, DEADLINE))

        d.config["flush"]["interval"] = "200ms"
        d.config["log"]["level"] = "info"
        d.config["buckets"]["max_late"] = "48h"
        d.reload()
        with open(d.config_path) as f:
            text = f.read()
        d.reload(text=text.replace("max_late: 48h", "max_late: 48 hours"),
                 expect="the running configuration stays in force")
        d.reload()
        self.assertTrue(bdtest.wait_for(lambda: len(loads["tcp-new"].sent_at) >= 300, DEADLINE))
        for load in loads.values():
            load.finish(self)
        stats = d.stop()

        # What must be stored exactly once: everything sent to a listener that existed, the
        # readings sent to the removed UDP listener before the reload included.
        gone = loads["udp-gone"]
        before = [r for r, t in zip(gone.sent, gone.sent_at) if t < hup_ns]
        after = gone.sent[len(before):]
        docs = self.documents(client, db)
        stored = {(doc["sensor_id"], r["seq"]) for doc in docs for r in doc["readings"]}
        after_stored = [r for r in after if (r.sensor_id, r.seq) in stored]
        expected = [r for name, l in loads.items() if name != "udp-gone" for r in l.sent]
        expected += before + after_stored
        self.assertNoProblems(bdtest.check_readings(docs, expected, SPAN_S), "readings", d)
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, 3600), "documents", d)
        sys.stderr.write("\n[reload under load] %d readings stored once; of %d sent to the UDP "
                         "listener after the SIGHUP that removed it, %d were stored and %d lost "
                         "(sent to a closed port)\n" % (len(expected), len(after),
                                                          len(after_stored),
                                                          len(after) - len(after_stored)))
        self.assertStat(stats, "config_reloads", 4, d)
        self.assertStat(stats, "config_reload_errors", 1, d)
        self.assertStat(stats, "udp_socket_drops", 0, d)

    def test_a_file_that_does_not_validate_changes_nothing(self):
        client, db, ns, d = self.start_notifying()
        with open(d.config_path) as f:
            good = f.read()
        self.assertIn("  interval: 200ms\n", good)
        broken = good.replace("  interval: 200ms\n", "  interval: 2 s\n")
        lines = broken.splitlines()
        row = next(i for i, l in enumerate(lines) if l == "  interval: 2 s") + 1
        before_us = time.monotonic_ns() // 1000
        added = d.reload(text=broken, expect="the running configuration stays in force")
        after_us = time.monotonic_ns() // 1000
        self.assertIn('%s:%d:13: flush.interval: "2 s" is not a duration' % (d.config_path, row),
                      added)

        reloading, ready = ns.next(), ns.next()
        self.assertEqual(reloading.get("RELOADING"), "1", ns.messages)
        self.assertTrue(before_us <= int(reloading["MONOTONIC_USEC"]) <= after_us, reloading)
        self.assertEqual(ready.get("READY"), "1", ns.messages)
        self.assertIn("reload refused", ready.get("STATUS", ""))

        readings = sr.make_readings(sensors=4, per_sensor=25, seed=3)
        self.send_tcp(d, readings)
        self.assertStoredOnce(client, db, readings, d)
        stats = d.stop()
        self.assertStat(stats, "config_reload_errors", 1, d)
        self.assertStat(stats, "config_reloads", 0, d)

    def test_keys_that_need_a_restart_are_named_and_keep_their_values(self):
        client, db, ns, d = self.start_notifying()
        # A TCP connection is logged at debug only: this one, accepted (its readings are
        # stored) while at info, is not.
        first = sr.make_readings(sensors=3, per_sensor=10, seed=4, seq_base=0)
        self.send_tcp(d, first)
        self.assertEqual(bdtest.wait_stored(client, db, len(first), DEADLINE), len(first))
        d.config["mongodb"]["collection"] = "elsewhere"
        d.config["log"]["level"] = "debug"
        d.config["limits"] = {"max_sensors": 10000000}
        added = d.reload()
        self.assertIn("reload: mongodb.collection: buckets -> elsewhere needs a restart; "
                      "keeping buckets until then", added)
        self.assertIn("reload: log.level: info -> debug", added)
        self.assertIn("reload: limits.max_sensors: 10000000 is more than the sensor queues "
                      "reserved at start hold (131072); keeping 100000 until a restart", added)
        self.assertEqual(ns.next().get("RELOADING"), "1")
        ready = ns.next()
        self.assertEqual((ready.get("READY"), ready.get("STATUS")),
                         ("1", "ready (configuration reloaded)"))

        self.assertNotIn("connection from", d.log())
        readings = first + sr.make_readings(sensors=3, per_sensor=20, seed=4, seq_base=1000)
        self.send_tcp(d, readings[len(first):])
        self.wait_log(d, "connection from")
        self.assertStoredOnce(client, db, readings, d)
        self.assertEqual(client[db]["elsewhere"].count_documents({}), 0)
        stats = d.stop()
        self.assertStat(stats, "config_reloads", 1, d)

    def test_retention_index_follows_the_configuration(self):
        uri, client, db = self.new_database()
        d = self.daemon(uri, db, extra={"buckets": {"retention": "48h"},
                                        "summaries": {"retention": "96h"}})
        d.start()
        self.wait_log(d, "buckets.retention: documents of %s.buckets are deleted by MongoDB "
                         "172800 s after their bucket_end (TTL index bucket_end_ttl created)" % db)
        self.wait_log(d, "summaries.retention: documents of %s.buckets_summary are deleted by "
                         "MongoDB 345600 s after their bucket_end (TTL index bucket_end_ttl "
                         "created)" % db)
        self.assertEqual(ttl_of(client, db, "buckets"), 172800)
        self.assertEqual(ttl_of(client, db, "buckets_summary"), 345600)

        d.config["buckets"]["retention"] = "72h"
        d.config["summaries"]["retention"] = "72h"
        d.reload()
        self.wait_log(d, "(TTL index bucket_end_ttl changed from 172800 s by collMod)")
        self.wait_log(d, "(TTL index bucket_end_ttl changed from 345600 s by collMod)")
        self.assertEqual(ttl_of(client, db, "buckets"), 259200)
        self.assertEqual(ttl_of(client, db, "buckets_summary"), 259200)

        d.config["buckets"]["retention"] = "0"
        d.config["summaries"]["retention"] = "0"
        d.reload()
        self.wait_log(d, "buckets.retention: off; TTL index bucket_end_ttl dropped from "
                         "%s.buckets" % db)
        self.wait_log(d, "summaries.retention: off; TTL index bucket_end_ttl dropped from "
                         "%s.buckets_summary" % db)
        self.assertIsNone(ttl_of(client, db, "buckets"))
        self.assertIsNone(ttl_of(client, db, "buckets_summary"))

        readings = sr.make_readings(sensors=2, per_sensor=10, seed=5)
        self.send_tcp(d, readings)
        self.assertStoredOnce(client, db, readings, d)
        d.stop()

    def test_an_index_of_the_operator_on_bucket_end_is_left_alone(self):
        uri, client, db = self.new_database()
        client[db]["buckets"].create_index("bucket_end", name="by_end")
        d = self.daemon(uri, db, extra={"buckets": {"retention": "48h"}})
        d.start()
        self.wait_log(d, "buckets.retention: cannot set the TTL index bucket_end_ttl on "
                         "%s.buckets (tried again in 60 s): index by_end already covers "
                         "{bucket_end: 1}" % db)
        names = {ix["name"]: ix for ix in client[db]["buckets"].list_indexes()}
        self.assertNotIn("bucket_end_ttl", names)
        self.assertNotIn("expireAfterSeconds", names["by_end"])
        readings = sr.make_readings(sensors=2, per_sensor=10, seed=6)
        self.send_tcp(d, readings)
        self.assertStoredOnce(client, db, readings, d)
        d.stop()


if __name__ == "__main__":
    unittest.main()
