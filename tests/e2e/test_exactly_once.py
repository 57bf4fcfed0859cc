#!/usr/bin/python3
"""Exactly once through network faults, retries, restarts and several writers (DESIGN.md §3.1).

A steady load from bucketd-sim (TCP, so nothing is lost before the daemon accepts it; every
reading carries a unique integer field `seq`) goes through the real daemon, through the fault
proxy (tests/fault_proxy.py) where a fault is injected, into the test server. Afterwards every
sequence number sent must be stored exactly once, every document invariant must hold
(bdtest.check_documents and `bucketd-inspect verify`), and the counters must show that the
fault really happened (retries, updates MongoDB had already applied).

Run: /usr/bin/python3 tests/e2e/test_exactly_once.py
Environment (besides bdtest.py's): BUCKETD_SIM_BIN, BUCKETD_INSPECT_BIN (defaults under
<repo>/build). With BUCKETD_TEST_MONGODB_URI the same tests run against a real MongoDB.
"""

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bdtest  # noqa: E402

SIM = os.environ.get("BUCKETD_SIM_BIN") or os.path.join(bdtest.REPO, "build", "bucketd-sim")
INSPECT = (os.environ.get("BUCKETD_INSPECT_BIN") or
           os.path.join(bdtest.REPO, "build", "bucketd-inspect"))
SPAN_S = 3600
CAP = 40  # readings per page: small, so pages fill up and restarts must find the right one


# ---------------------------------------------------------------------------------------------
# Load, checks
# ---------------------------------------------------------------------------------------------

class Load:
    """bucketd-sim over TCP in the background: `count` readings from seq_start at `rate`/s."""

    def __init__(self, target, seq_start, count, rate, sensors=12, seed=1, spread=5400):
        self.seq_start, self.count = seq_start, count
        self.proc = subprocess.Popen(
            [SIM, "--target", "%s:%d" % target, "--proto", "tcp", "--seq",
             "--seq-start", str(seq_start), "--count", str(count), "--rate", str(rate),
             "--sensors", str(sensors), "--fields", "2", "--spread", str(spread),
             "--seed", str(seed)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def seqs(self):
        return set(range(self.seq_start, self.seq_start + self.count))

    def finish(self, timeout=120):
        out, err = self.proc.communicate(timeout=timeout)
        lines = out.decode("utf-8", "replace").splitlines()
        summary = json.loads(lines[0]) if len(lines) == 1 else None
        return self.proc.returncode, summary, err.decode("utf-8", "replace")


def stored_seqs(docs):
    """Counter of the seq field over every stored reading."""
    seqs = collections.Counter()
    for doc in docs:
        for r in doc.get("readings", []):
            seqs[r["seq"]] += 1
    return seqs


def inspect_verify(uri, database):
    p = subprocess.run([INSPECT, "--uri", uri, "--database", database, "verify",
                        "--max-readings", str(CAP)],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    return p.returncode, (p.stdout + p.stderr).decode("utf-8", "replace")


def with_uri_options(uri, **opts):
    """uri with query options added (or replaced)."""
    parts = urllib.parse.urlsplit(uri)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query.update({k: str(v) for k, v in opts.items()})
    path = parts.path or "/"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path,
                                    urllib.parse.urlencode(query), ""))


def mongo_hostport(uri):
    netloc = urllib.parse.urlsplit(uri).netloc.rsplit("@", 1)[-1]
    host, _, port = netloc.split(",")[0].rpartition(":")
    return host.strip("[]"), int(port)


class ExactlyOnceCase(bdtest.E2ECase):
    db_prefix = "e2e_once"

    @classmethod
    def setUpClass(cls):
        for path, env in ((SIM, "BUCKETD_SIM_BIN"), (INSPECT, "BUCKETD_INSPECT_BIN")):
            if not os.access(path, os.X_OK):
                raise AssertionError("%s not found (set %s)" % (path, env))

    def new_daemon(self, uri, db, name, spool=None, writer_id=None, extra=None, **kw):
        cfg = {"spool": {"dir": spool or os.path.join(self.workdir, "spool-" + name)},
               "flush": {"retry_initial": "50ms", "retry_max": "1s"}}
        if writer_id:
            cfg["writer_id"] = writer_id
        cfg = bdtest.deep_merge(cfg, extra or {})
        kw.setdefault("listeners", [{"name": "tcp", "proto": "tcp", "format": "influx"}])
        kw.setdefault("max_readings", CAP)
        return self.daemon(uri, db, name=name, extra=cfg, **kw)

    def run_load(self, target, seq_start, count, rate, **kw):
        load = Load(target, seq_start, count, rate, **kw)
        rc, summary, err = load.finish()
        self.assertEqual(rc, 0, "bucketd-sim failed: %s" % err)
        self.assertEqual(summary["readings"], count)
        return load

    def assertExactlyOnce(self, uri, client, db, want, daemons=(), lost_ok=None):
        """Every seq in want stored exactly once (lost_ok: seqs that may be missing), nothing
        else stored, all invariants true."""
        docs = self.documents(client, db)
        seqs = stored_seqs(docs)
        twice = sorted(s for s, n in seqs.items() if n > 1)
        extra = sorted(set(seqs) - want)
        missing = sorted(want - set(seqs))
        logs = "".join("\n--- log %s ---\n%s" % (d.log_path, bdtest.log_tail(d.log(), 40))
                       for d in daemons)
        self.assertEqual(twice[:20], [], "readings stored twice (%d)%s" % (len(twice), logs))
        self.assertEqual(extra[:20], [], "readings never sent were stored%s" % logs)
        if lost_ok is None:
            self.assertEqual(missing[:20], [], "readings missing (%d of %d)%s" % (
                len(missing), len(want), logs))
        else:
            self.assertEqual(sorted(set(missing) - lost_ok)[:20], [],
                             "readings missing outside the allowed loss%s" % logs)
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, CAP), "invariants")
        rc, out = inspect_verify(uri, db)
        self.assertEqual(rc, 0, "bucketd-inspect verify:\n%s" % out)
        return missing

    def wait_all_stored(self, client, db, n, timeout=60):
        return bdtest.wait_stored(client, db, n, timeout)


# ---------------------------------------------------------------------------------------------
# Restarts and writers (no proxy)
# ---------------------------------------------------------------------------------------------

class Restarts(ExactlyOnceCase):

    def test_sigterm_restart_continues_pages_and_sequence(self):
        """Stop and start again on the same spool: pages written before the restart are found
        and filled up to the cap, the sequence continues, nothing is stored twice."""
        uri, client, db = self.new_database()
        spool = os.path.join(self.workdir, "spool")
        d1 = self.new_daemon(uri, db, "d1", spool=spool).start()
        l1 = self.run_load(d1.addr("tcp"), 0, 3000, 3000)
        self.wait_all_stored(client, db, 3000)
        st1 = d1.stop()
        self.assertStat(st1, "readings_flushed", 3000, d1)

        d2 = self.new_daemon(uri, db, "d2", spool=spool).start()
        self.assertFalse([l for l in d2.log_lines(max_priority=4)
                          if "did not stop cleanly" in l], "a clean stop is not reported")
        l2 = self.run_load(d2.addr("tcp"), 3000, 3000, 3000)
        self.wait_all_stored(client, db, 6000)
        st2 = d2.stop()
        self.assertStat(st2, "readings_flushed", 3000, d2)
        self.assertGreater(st2["page_lookups"], 0, "the restart looked up existing pages")
        self.assertStat(st2, "writer_conflicts", 0, d2)
        self.assertExactlyOnce(uri, client, db, l1.seqs() | l2.seqs(), (d1, d2))
        # Buckets were continued, not restarted at page 0 (that would break the page cap).
        docs = self.documents(client, db)
        self.assertGreater(max(doc["page"] for doc in docs), 1)

    def test_sigkill_loses_only_the_last_interval_and_duplicates_nothing(self):
        uri, client, db = self.new_database()
        spool = os.path.join(self.workdir, "spool")
        rate = 2000
        d1 = self.new_daemon(uri, db, "d1", spool=spool, flush_interval="300ms").start()
        l1 = Load(d1.addr("tcp"), 0, 20000, rate)
        # Kill while readings are arriving and being flushed.
        bdtest.wait_for(lambda: bdtest.stored_count(client, db) >= 3000, 30)
        d1.kill()
        l1.finish()  # the simulator sees the connection die; what it wrote is the upper bound
        sent1 = bdtest.stored_count(client, db)

        d2 = self.new_daemon(uri, db, "d2", spool=spool).start()
        warn = [l for l in d2.log_lines(max_priority=4) if "did not stop cleanly" in l]
        self.assertEqual(len(warn), 1, "the restart reports the unclean stop:\n" + d2.log())
        l2 = self.run_load(d2.addr("tcp"), 100000, 3000, 3000)
        self.wait_all_stored(client, db, sent1 + 3000)
        st2 = d2.stop()
        self.assertStat(st2, "writer_conflicts", 0, d2)
        self.assertStat(st2, "readings_flushed", 3000, d2)

        # Everything from before the kill that reached MongoDB is there once; what is missing
        # of the first load was accepted in the last interval or never left the socket
        # buffers. Bound loosely: at most a few seconds of the load.
        docs = self.documents(client, db)
        seqs = stored_seqs(docs)
        first = {s for s in seqs if s < 100000}
        self.assertGreaterEqual(len(first), 3000)
        top = max(first)
        missing_below_top = set(range(0, top)) - first
        self.assertLessEqual(len(missing_below_top), 3 * rate,
                             "losses spread beyond the last flush interval")
        self.assertExactlyOnce(uri, client, db, first | l2.seqs(), (d1, d2))

    def test_lost_state_file_is_recovered_from_the_collection(self):
        """Without writer.state the sequence continues above what the collection holds."""
        uri, client, db = self.new_database()
        spool = os.path.join(self.workdir, "spool")
        d1 = self.new_daemon(uri, db, "d1", spool=spool).start()
        l1 = self.run_load(d1.addr("tcp"), 0, 2000, 4000)
        self.wait_all_stored(client, db, 2000)
        d1.stop()
        os.unlink(os.path.join(spool, "writer.state"))

        d2 = self.new_daemon(uri, db, "d2", spool=spool).start()
        l2 = self.run_load(d2.addr("tcp"), 2000, 2000, 4000)
        self.wait_all_stored(client, db, 4000)
        st2 = d2.stop()
        self.assertStat(st2, "writer_conflicts", 0, d2)
        self.assertStat(st2, "updates_already_applied", 0, d2)
        self.assertTrue(any("flush sequence continues above" in l for l in d2.log_lines()),
                        d2.log())
        self.assertExactlyOnce(uri, client, db, l1.seqs() | l2.seqs(), (d1, d2))

    def test_second_daemon_on_the_same_spool_is_refused(self):
        uri, client, db = self.new_database()
        spool = os.path.join(self.workdir, "spool")
        d1 = self.new_daemon(uri, db, "d1", spool=spool).start()
        d2 = self.new_daemon(uri, db, "d2", spool=spool, writer_id="other")
        with self.assertRaises(bdtest.DaemonError):
            d2.start()
        self.assertEqual(d2.returncode, 1)
        self.assertIn("is in use by another bucketd", d2.log())
        self.assertTrue(d1.alive())
        d1.stop()


class Writers(ExactlyOnceCase):

    def test_two_writer_ids_into_the_same_buckets(self):
        """Two daemons, different writer ids, the same sensors: both append, nothing lost or
        doubled, summaries true."""
        uri, client, db = self.new_database()
        # Pages hold what both daemons append; one writer's page accounting cannot see the
        # other's readings, so the cap is generous here (DESIGN: k writers, k x cap at most).
        big = {"buckets": {"max_readings": 100000}}
        da = self.new_daemon(uri, db, "a", writer_id="gw-a", extra=big).start()
        db_ = self.new_daemon(uri, db, "b", writer_id="gw-b", extra=big).start()
        la = Load(da.addr("tcp"), 0, 4000, 4000, seed=1)
        lb = Load(db_.addr("tcp"), 100000, 4000, 4000, seed=2)
        for load in (la, lb):
            rc, _, err = load.finish()
            self.assertEqual(rc, 0, err)
        self.wait_all_stored(client, db, 8000)
        for d in (da, db_):
            st = d.stop()
            self.assertStat(st, "writer_conflicts", 0, d)
            self.assertStat(st, "updates_quarantined", 0, d)
        docs = self.documents(client, db)
        self.assertTrue(any(len(doc.get("w", {})) == 2 for doc in docs),
                        "some bucket was written by both")
        seqs = stored_seqs(docs)
        self.assertEqual(sorted(s for s, n in seqs.items() if n > 1), [])
        self.assertEqual(set(seqs), la.seqs() | lb.seqs())
        self.assertNoProblems(bdtest.check_documents(docs, SPAN_S, 100000), "invariants")

    def test_same_writer_id_on_two_spools_is_detected(self):
        """A second daemon with the same writer_id (its own spool) takes the sequence above the
        first's; the first's next update of a shared bucket is refused, counted, logged."""
        uri, client, db = self.new_database()
        da = self.new_daemon(uri, db, "a", writer_id="dup").start()
        self.run_load(da.addr("tcp"), 0, 500, 5000, sensors=2, spread=0)
        self.wait_all_stored(client, db, 500)
        dz = self.new_daemon(uri, db, "z", writer_id="dup").start()
        self.run_load(dz.addr("tcp"), 10000, 500, 5000, sensors=2, spread=0)
        self.wait_all_stored(client, db, 1000)
        self.run_load(da.addr("tcp"), 20000, 500, 5000, sensors=2, spread=0)
        ok = bdtest.wait_for(lambda: (da.stats() or {}).get("writer_conflicts", 0) > 0 or
                             any("another daemon is using writer_id dup" in l
                                 for l in da.log_lines()), 30)
        st = da.stop()
        dz.stop()
        self.assertTrue(ok, da.log())
        self.assertGreater(st["writer_conflicts"], 0, da.log())
        self.assertEqual(st["readings_quarantined"] + st["readings_flushed"], 1000)
        seqs = stored_seqs(self.documents(client, db))
        self.assertEqual(sorted(s for s, n in seqs.items() if n > 1), [])


if __name__ == "__main__":
    unittest.main(verbosity=2)
