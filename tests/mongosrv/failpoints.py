"""Fail points: what mongod offers tests with --setParameter enableTestCommands=1.

FailPoint keeps one fail point and its mode (src/mongo/util/fail_point.cpp); FailPointCommands
gives Backend configureFailPoint and the failCommand checks run before and after each command
(src/mongo/db/commands.cpp evaluateFailCommandFailPoint), including this server's
writeErrorCode extension.
"""

from bson.decimal128 import Decimal128
from bson.int64 import Int64

from .bsonvalues import INT32_MAX, is_number, type_name
from .errors import CommandError, error_reply


class FailPoint(object):
    """One fail point and its mode, as src/mongo/util/fail_point.cpp keeps it: "off",
    "alwaysOn", {times: N} (the next N passes, then off) or {skip: N} (every pass after the
    first N).  A pass is counted only when the caller's condition holds (the command is one
    the data names), as FailPoint::executeIf checks the predicate before the mode."""

    __slots__ = ('mode', 'value', 'data', 'entered')

    def __init__(self):
        self.mode = 'off'
        self.value = 0
        self.data = {}
        self.entered = 0

    def configure(self, cmd):
        """Parse a configureFailPoint command like FailPoint::parseBSON; returns the number
        of times the fail point was entered so far (the reply's "count")."""
        if 'mode' not in cmd:
            raise CommandError(20, "When setting a failpoint, you must supply a 'mode'")
        mode = cmd['mode']
        value = 0
        if isinstance(mode, str):
            if mode not in ('off', 'alwaysOn'):
                raise CommandError(2, 'unknown mode: %s' % mode)
        elif isinstance(mode, dict):
            for key in ('times', 'skip'):
                if key in mode:
                    v = mode[key]
                    if not is_number(v) or isinstance(v, Decimal128):
                        raise CommandError(14, "Expected field \"%s\" to have numeric type, but "
                                               "found %s" % (key, type_name(v)))
                    value = int(v)
                    if value < 0:
                        raise CommandError(2, "'%s' option to 'mode' must be positive" % key)
                    if value > INT32_MAX:
                        raise CommandError(2, "'%s' option to 'mode' is too large" % key)
                    break
            else:
                if 'activationProbability' in mode:
                    raise CommandError(238, 'activationProbability is not supported by the '
                                            'test server')
                raise CommandError(2, "'mode' must be one of 'off', 'alwaysOn', '{times:n}', "
                                      "'{skip:n}' or '{activationProbability:p}'")
            mode = key
            if mode == 'times' and value == 0:
                mode = 'off'
        else:
            raise CommandError(14, "'mode' must be a string or JSON object")
        data = cmd.get('data', {})
        if not isinstance(data, dict):
            raise CommandError(14, "the 'data' option must be a JSON object")
        self.mode, self.value, self.data = mode, value, data
        return self.entered

    def enter(self):
        """One pass whose condition held: the data if the fail point fires, else None."""
        if self.mode == 'off':
            return None
        if self.mode == 'times':
            self.value -= 1
            if self.value <= 0:
                self.mode = 'off'
        elif self.mode == 'skip' and self.value > 0:
            self.value -= 1
            return None
        self.entered += 1
        return self.data


# The names under which one command answers (Command::hasAlias): a failCommands entry names
# the command by any of them.
_COMMAND_ALIASES = {'isMaster': 'hello', 'ismaster': 'hello', 'buildinfo': 'buildInfo',
                    'findandmodify': 'findAndModify', 'getlasterror': 'getLastError',
                    'deleteIndexes': 'dropIndexes'}

# Commands for which Command::supportsWriteConcern is true, i.e. that a failCommand
# writeConcernError can be attached to.
WRITE_CONCERN_COMMANDS = frozenset((
    'insert', 'update', 'delete', 'findAndModify', 'create', 'drop', 'dropDatabase',
    'createIndexes', 'dropIndexes', 'renameCollection', 'collMod'))

FAIL_COMMAND_MSG = "Failing command via 'failCommand' failpoint"


def aggregate_writes(cmd):
    """Whether an aggregate writes (ends with $merge or $out), which makes it a command that
    supports writeConcern (Pipeline::aggHasWriteStage)."""
    pipeline = cmd.get('pipeline')
    return (isinstance(pipeline, list) and pipeline and isinstance(pipeline[-1], dict) and
            ('$merge' in pipeline[-1] or '$out' in pipeline[-1]))


# The write commands a failCommand writeErrorCode (an extension of this server) can fail.
WRITE_ERROR_COMMANDS = frozenset(('insert', 'update', 'delete'))


class FailAction(object):
    """What failCommand does to one command before it runs."""
    __slots__ = ('block_ms', 'close', 'reply', 'write_errors')

    def __init__(self):
        self.block_ms = 0
        self.close = False
        self.reply = None
        # (code, statement indexes or None for all) for a writeErrorCode.
        self.write_errors = None


class FailPointCommands(object):
    """configureFailPoint and the failCommand fail point, for Backend."""

    def cmd_configureFailPoint(self, db, cmd, name, conn):
        if db != 'admin':
            raise CommandError(13, 'configureFailPoint may only be run against the admin '
                                   'database.')
        fp_name = cmd[name]
        with self.fp_lock:
            fp = self.fail_points.get(fp_name) if isinstance(fp_name, str) else None
            if fp is None:
                raise CommandError(266, '%s not found' % (fp_name,))
            count = fp.configure(cmd)
        return {'count': Int64(count), 'ok': 1.0}

    def note_client(self, conn_id, cmd):
        """Remember the appName a connection's handshake gave (failCommand's appName)."""
        client = cmd.get('client')
        app = client.get('application') if isinstance(client, dict) else None
        name = app.get('name') if isinstance(app, dict) else None
        if isinstance(name, str):
            self.conn_app[conn_id] = name

    def forget_connection(self, conn_id):
        self.conn_app.pop(conn_id, None)

    def _fail_command_applies(self, data, db, name, cmd, conn_id):
        """CommandHelpers::shouldActivateFailCommandFailPoint (src/mongo/db/commands.cpp)."""
        if name == 'configureFailPoint':  # banned even if listed
            return False
        if 'appName' in data and data['appName'] != self.conn_app.get(conn_id, ''):
            return False
        if 'namespace' in data:
            target = cmd.get(name)
            ns = '%s.%s' % (db, target) if isinstance(target, str) else db
            if data['namespace'] != ns:
                return False
        if data.get('failAllCommands'):
            return True
        canonical = _COMMAND_ALIASES.get(name, name)
        names = data.get('failCommands')
        return isinstance(names, list) and any(
            isinstance(n, str) and _COMMAND_ALIASES.get(n, n) == canonical for n in names)

    def fail_command_before(self, db, name, cmd, conn_id):
        """CommandHelpers::evaluateFailCommandFailPoint: a FailAction, or None when the fail
        point does not fire.  Only data with closeConnection, blockConnection or an integer
        errorCode counts a pass here (or a writeErrorCode, for a write command)."""
        if name not in self.commands:
            return None
        with self.fp_lock:
            fp = self.fail_points['failCommand']
            if fp.mode == 'off':
                return None
            data = fp.data
            close = data.get('closeConnection') is True
            block = data.get('blockConnection') is True
            code = data.get('errorCode')
            has_code = is_number(code) and not isinstance(code, Decimal128)
            wcode = data.get('writeErrorCode')
            has_wcode = (is_number(wcode) and not isinstance(wcode, Decimal128)
                         and _COMMAND_ALIASES.get(name, name) in WRITE_ERROR_COMMANDS)
            if not (close or block or has_code or has_wcode):
                return None
            if not self._fail_command_applies(data, db, name, cmd, conn_id):
                return None
            data = fp.enter()
        if data is None:
            return None
        action = FailAction()
        labels = data.get('errorLabels')
        if block:
            ms = data.get('blockTimeMS')
            if not is_number(ms) or isinstance(ms, Decimal128):
                action.reply = error_reply(72, "must specify 'blockTimeMS' when "
                                               "'blockConnection' is true")
                return action
            if ms < 0:
                action.reply = error_reply(72, "'blockTimeMS' must be non-negative")
                return action
            action.block_ms = int(ms)
        if close:
            action.close = True
            return action
        if has_code:
            action.reply = error_reply(int(code), FAIL_COMMAND_MSG)
            # errorLabels in the data replace whatever labels the server would have given
            # (errorLabelsOverride); none otherwise, since a standalone has no retryable
            # writes to label.
            if isinstance(labels, list) and labels:
                action.reply['errorLabels'] = list(labels)
        elif has_wcode:
            indexes = data.get('writeErrorIndexes')
            if isinstance(indexes, list):
                indexes = frozenset(int(i) for i in indexes if is_number(i))
            else:
                indexes = None
            action.write_errors = (int(wcode), indexes)
        return action

    def fail_command_after(self, db, name, cmd, conn_id, reply):
        """The writeConcernError of a failCommand, attached to the reply of a command that
        ran (its writes applied), in place of waiting for the write concern."""
        if _COMMAND_ALIASES.get(name, name) not in WRITE_CONCERN_COMMANDS and not (
                name == 'aggregate' and aggregate_writes(cmd)):
            return
        with self.fp_lock:
            fp = self.fail_points['failCommand']
            if fp.mode == 'off' or 'writeConcernError' not in fp.data:
                return
            if not self._fail_command_applies(fp.data, db, name, cmd, conn_id):
                return
            data = fp.enter()
        if data is not None:
            reply['writeConcernError'] = data['writeConcernError']
            # As with errorCode, the data's errorLabels replace the server's own
            # (RunCommandAndWaitForWriteConcern sets errorLabelsOverride): none if empty.
            labels = data.get('errorLabels')
            if isinstance(labels, list) and labels:
                reply['errorLabels'] = list(labels)
