# -*- coding: utf-8 -*-
"""Start and stop the MongoDB test server (tests/mongo_server.py) from tests.

    from mongo_fixture import start_mongo, unique_db_name

    with start_mongo() as mongo:
        client = pymongo.MongoClient(mongo.uri)
        db = client[unique_db_name('e2e')]
        ...

When BUCKETD_TEST_MONGODB_URI is set, start_mongo() starts nothing and hands
out that URI instead, so the same tests run against a real MongoDB.

The server's strictness switches (see tests/mongo_server.py) are keyword arguments:

    start_mongo(sharded='sensor_id:1,bucket_start:1', unstable_sortarray=True,
                fail_command={'mode': {'times': 1}, 'data': {...}}, max_write_batch=2)

A test that needs one of them to hold should pass use_external=False, or check .owned: an
external MongoDB is whatever it is.
"""

import json
import os
import select
import signal
import subprocess
import tempfile
import time
import uuid

PYTHON = '/usr/bin/python3'
HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.normpath(os.path.join(HERE, '..', 'mongo_server.py'))
URI_ENV = 'BUCKETD_TEST_MONGODB_URI'


def external_uri():
    """The real MongoDB to test against, or None."""
    return os.environ.get(URI_ENV) or None


def unique_db_name(prefix='bucketd_test'):
    """A database name no other test run uses (MongoDB allows 63 bytes)."""
    name = '%s_%d_%s' % (prefix, os.getpid(), uuid.uuid4().hex[:10])
    return name[:63]


class MongoServer(object):
    """A running test server (owned) or an external MongoDB (not owned)."""

    def __init__(self, uri, proc=None, port=None, log=None):
        self.uri = uri
        self.proc = proc
        self.port = port
        self._log = log
        self._final_log = ''

    @property
    def owned(self):
        return self.proc is not None

    def log_text(self):
        """What the server wrote to stderr so far."""
        if self._log is None:
            return self._final_log
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode('utf-8', 'replace')

    def stop(self, timeout=10.0):
        """SIGTERM our server, wait for it, and check that it exited 0.
        Returns the exit status (None for an external MongoDB)."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError('mongo_server.py did not exit within %.0fs of SIGTERM:\n%s'
                                     % (timeout, self.log_text()))
            if rc != 0:
                raise AssertionError('mongo_server.py exited with status %r:\n%s'
                                     % (rc, self.log_text()))
            return rc
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
            if self._log is not None:
                self._final_log = self.log_text()
                self._log.close()
                self._log = None

    def discard(self):
        """Forget a server process that has ended, closing its pipes."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        if self._log is not None:
            self._final_log = self.log_text()
            self._log.close()
            self._log = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.stop()
        else:
            try:
                self.stop()
            except AssertionError:
                pass  # keep the original failure

    def __del__(self):
        proc = getattr(self, 'proc', None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def server_args(sharded=None, unstable_sortarray=False, fail_command=None,
                max_write_batch=None):
    """The command-line switches of tests/mongo_server.py for these options.

    sharded: a KEYSPEC string ("sensor_id:hashed") or a list of (field, 1 | "hashed");
    fail_command: the mode and data of a configureFailPoint failCommand, a dict (values
    JSON can carry; bson.json_util.dumps gives the string form for other BSON types) or a
    string of JSON; max_write_batch: hello's maxWriteBatchSize (None: the server's default)."""
    args = []
    if sharded is not None:
        if not isinstance(sharded, str):
            sharded = ','.join('%s:%s' % (field, kind) for field, kind in sharded)
        args += ['--sharded', sharded]
    if unstable_sortarray:
        args.append('--unstable-sortarray')
    if fail_command is not None:
        if not isinstance(fail_command, str):
            fail_command = json.dumps(fail_command)
        args += ['--fail-command', fail_command]
    if max_write_batch is not None:
        args += ['--max-write-batch', str(int(max_write_batch))]
    return args


def start_mongo(port=None, verbose=False, timeout=15.0, use_external=True, sharded=None,
                unstable_sortarray=False, fail_command=None, max_write_batch=None):
    """Start tests/mongo_server.py and wait until it listens.

    Returns a MongoServer with .uri ("mongodb://127.0.0.1:PORT/").  With
    BUCKETD_TEST_MONGODB_URI set (and use_external true) nothing is started
    and .uri is that URI.  sharded, unstable_sortarray, fail_command and max_write_batch:
    see server_args."""
    uri = external_uri()
    if uri and use_external:
        return MongoServer(uri)
    cmd = [PYTHON, SERVER]
    if port:
        cmd += ['--port', str(port)]
    if verbose:
        cmd.append('--verbose')
    cmd += server_args(sharded, unstable_sortarray, fail_command, max_write_batch)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=log, close_fds=True)
    server = MongoServer(None, proc, log=log)
    deadline = time.monotonic() + timeout
    line = b''
    while not line.endswith(b'\n'):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            server.proc.kill()
            server.proc.wait()
            text = server.log_text()
            server.discard()
            raise RuntimeError('mongo_server.py did not report its port within %.0fs:\n%s'
                               % (timeout, text))
        ready, _, _ = select.select([proc.stdout], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(proc.stdout.fileno(), 64)
        if not chunk:
            rc = proc.wait()
            text = server.log_text()
            server.discard()
            raise RuntimeError('mongo_server.py exited with status %r before listening:\n%s'
                               % (rc, text))
        line += chunk
    server.port = int(line.strip())
    server.uri = 'mongodb://127.0.0.1:%d/' % server.port
    return server
