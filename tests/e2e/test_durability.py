#!/usr/bin/python3
"""Durability whatever bucketd knows of MongoDB (issue: spool what was accepted while MongoDB is
away, placed or not): a gateway that loses its uplink and then its power.

Each test runs the real daemon, sends readings over real UDP sockets (test_spool.py's sender:
every reading a unique `seq`, its timestamp and value remembered with the time it was sent) and
talks to MongoDB through the fault proxy. Expected values come from what was sent. A reading sent
more than KILL_BOUND_S (test_spool.py) before a SIGKILL must be stored exactly once; none may be
stored twice.

  test_reboot_during_outage_two_sigkills  readings while MongoDB is up, MongoDB away, SIGKILL,
                                          restart while it is still away (every bucket's pages
                                          unknown), more readings, a second SIGKILL, restart,
                                          MongoDB back
  test_first_start_offline_sigkill        no writer.state and MongoDB away from the first
                                          start: readings accepted and spooled unplaced, SIGKILL,
                                          restart with MongoDB back
  test_stop_offline_start_offline         first start offline, SIGTERM (everything spooled),
                                          another start offline with more readings, SIGTERM,
                                          a start with MongoDB back: everything stored once

Run: /usr/bin/python3 tests/e2e/test_durability.py [-k NAME]
"""

import os
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for fault_proxy

import bdtest  # noqa: E402
import test_spool  # noqa: E402
from test_spool import DEADLINE, KILL_BOUND_S, UdpSender, log, stored_seqs  # noqa: E402

PHASE_S = test_spool._env_num("BUCKETD_TEST_DURABILITY_PHASE_S", 6.0)
RATE = test_spool._env_num("BUCKETD_TEST_DURABILITY_RATE", 3000, int)
# A small limits.memory: half of it the sensor queues' pool (512 KiB of 1 KiB segments, a
# reading of two fields taking some 40 bytes there), half the batches (a reading some 70 bytes):
# about 20 k readings, 7 s at RATE. The second run's outage (3 x PHASE_S) sends more than twice
# that, so the spool must take the readings whatever is known of MongoDB.
MEMORY = 1 << 20


class Durability(test_spool.Spool):
    db_prefix = "e2e_durable"

    def durable_daemon(self, uri, db, name, spool):
        return self.new_daemon(uri, db, name, spool,
                               extra={"limits": {"memory": MEMORY}})

    def required(self, sender, t_kill):
        return {s for s, at in zip(sender.seqs(), sender.sent_at) if at < t_kill - KILL_BOUND_S}

    def send_for(self, d, seconds, seq_start):
        s = UdpSender(d.addr("udp"), RATE, seq_start=seq_start)
        self.addCleanup(s.stop)
        s.start()
        time.sleep(seconds)  # the scenario's duration
        return s

    def kill(self, d, sender):
        t_kill = time.monotonic()
        d.kill()
        sender.stop()
        self.assertEqual(sender.errors, 0, "the sender's sendto failed")
        return t_kill

    def finish(self, client, db, d, want, senders, uri, daemons):
        ok = bdtest.wait_for(lambda: want <= stored_seqs(client, db), DEADLINE, 1.0)
        st = d.stop()
        self.assertTrue(ok, "%d readings required are not stored; stats %r\n%s" % (
            len(want - stored_seqs(client, db)), st, bdtest.log_tail(d.log(), 30)))
        missing = self.assertStored(client, db, senders, required=want, uri=uri,
                                    daemons=daemons)
        self.assertStats(st, d, readings_lost=0, writer_conflicts=0, updates_quarantined=0)
        return st, missing

    def test_reboot_during_outage_two_sigkills(self):
        uri, client, db = self.new_database()
        proxy, proxied = self.proxy_for(uri, client)
        spool = os.path.join(self.workdir, "spool")
        d1 = self.durable_daemon(proxied, db, "d1", spool).start()
        s1 = UdpSender(d1.addr("udp"), RATE).start()
        self.addCleanup(s1.stop)
        self.wait_proxy(proxy, "writes before the outage", lambda ps: ps["writes_forwarded"] >= 2,
                        d1)
        self.outage_begins(proxy, d1)
        time.sleep(PHASE_S)  # the scenario: MongoDB away, readings keep coming
        t1 = self.kill(d1, s1)

        # Restart while MongoDB is still away: every bucket's pages are unknown now.
        d2 = self.durable_daemon(proxied, db, "d2", spool).start()
        s2 = self.send_for(d2, 3 * PHASE_S, s1.seq_start + s1.count + 1_000_000)
        self.assertTrue(d2.alive(), "bucketd died during the outage\n" + bdtest.log_tail(d2.log()))
        t2 = self.kill(d2, s2)
        # The second run could place nothing: what it accepted went to the spool unplaced.
        log("run 2 was sent %d readings over %.0f s with MongoDB away (limits.memory %d KiB)"
            % (s2.count, 3 * PHASE_S, MEMORY >> 10))

        proxy.set_fault("pass")
        d3 = self.durable_daemon(proxied, db, "d3", spool).start()
        want = self.required(s1, t1) | self.required(s2, t2)
        st, missing = self.finish(client, db, d3, want, [s1, s2], uri, (d1, d2, d3))
        log("%d readings sent within %.1f s of a kill were lost with it; stats: placed %d, "
            "replayed %d" % (len(missing), KILL_BOUND_S, st["spool_records_placed"],
                             st["spool_records_replayed"]))
        self.assertGreater(st["spool_records_placed"], 0, st)
        self.assertGreater(len(self.required(s2, t2)), RATE * PHASE_S // 2,
                           "run 2 sent too little for the test to mean anything")

    def test_first_start_offline_sigkill(self):
        uri, client, db = self.new_database()
        proxy, proxied = self.proxy_for(uri, client)
        proxy.set_fault("refuse")
        spool = os.path.join(self.workdir, "spool")
        d1 = self.durable_daemon(proxied, db, "d1", spool).start()
        s1 = self.send_for(d1, 2 * PHASE_S, 0)
        self.assertTrue(d1.alive(), "bucketd died offline\n" + bdtest.log_tail(d1.log()))
        t1 = self.kill(d1, s1)
        self.assertGreater(bdtest.spool_record_bytes(spool), 0,
                           "nothing was spooled by a first start offline\n" + d1.log())

        proxy.set_fault("pass")
        d2 = self.durable_daemon(proxied, db, "d2", spool).start()
        want = self.required(s1, t1)
        self.assertGreater(len(want), 0)
        st, _ = self.finish(client, db, d2, want, [s1], uri, (d1, d2))
        self.assertGreater(st["spool_records_placed"], 0, st)

    def test_stop_offline_start_offline(self):
        uri, client, db = self.new_database()
        proxy, proxied = self.proxy_for(uri, client)
        proxy.set_fault("refuse")
        spool = os.path.join(self.workdir, "spool")
        d1 = self.durable_daemon(proxied, db, "d1", spool).start()
        s1 = self.send_for(d1, PHASE_S, 0)
        s1.stop()
        self.wait_udp_read(d1)
        st1 = d1.stop()
        self.assertStats(st1, d1, readings_accepted=s1.count, readings_lost=0)
        self.assertEqual(st1["readings_spooled_unplaced"], s1.count, st1)

        d2 = self.durable_daemon(proxied, db, "d2", spool).start()
        s2 = self.send_for(d2, PHASE_S, s1.count + 1_000_000)
        s2.stop()
        self.wait_udp_read(d2)
        st2 = d2.stop()
        self.assertStats(st2, d2, readings_accepted=s2.count, readings_lost=0)
        self.assertEqual(st2["readings_spooled_unplaced"], s2.count, st2)

        proxy.set_fault("pass")
        d3 = self.durable_daemon(proxied, db, "d3", spool).start()
        want = set(s1.seqs()) | set(s2.seqs())
        st, missing = self.finish(client, db, d3, want, [s1, s2], uri, (d1, d2, d3))
        self.assertEqual(missing, set())
        self.assertGreater(st["spool_records_placed"], 0, st)


# The spool tests themselves run in test_spool.py: only the helpers are inherited.
for _name in dir(test_spool.Spool):
    if _name.startswith("test_"):
        setattr(Durability, _name, None)


if __name__ == "__main__":
    unittest.main()
