"""Errors as MongoDB reports them: code names, the exceptions the command handlers raise
(CommandError, OperationFailure through fail, DupKeyError) and the error reply of a command.
"""

from pymongo.errors import DuplicateKeyError, OperationFailure


CODE_NAMES = {
    1: 'InternalError', 2: 'BadValue', 8: 'UnknownError', 9: 'FailedToParse',
    13: 'Unauthorized', 14: 'TypeMismatch', 20: 'IllegalOperation',
    26: 'NamespaceNotFound', 27: 'IndexNotFound', 40: 'ConflictingUpdateOperators',
    43: 'CursorNotFound', 48: 'NamespaceExists', 52: 'DollarPrefixedFieldName',
    59: 'CommandNotFound', 61: 'ShardKeyNotFound', 66: 'ImmutableField', 67: 'CannotCreateIndex',
    72: 'InvalidOptions', 73: 'InvalidNamespace', 76: 'NoReplicationEnabled',
    85: 'IndexOptionsConflict', 86: 'IndexKeySpecsConflict',
    16: 'InvalidLength', 238: 'NotImplemented', 10334: 'BSONObjectTooLarge',
    11000: 'DuplicateKey',
    17276: 'Location17276',
    6: 'HostUnreachable', 7: 'HostNotFound', 17: 'ProtocolError', 50: 'MaxTimeMSExpired',
    64: 'WriteConcernFailed', 89: 'NetworkTimeout', 91: 'ShutdownInProgress',
    112: 'WriteConflict', 121: 'DocumentValidationFailure', 134:
    'ReadConcernMajorityNotAvailableYet', 189: 'PrimarySteppedDown', 262: 'ExceededTimeLimit',
    266: 'FailPointSetFailed', 365: 'TemporarilyUnavailable', 9001: 'SocketException',
    10107: 'NotWritablePrimary',
    11600: 'InterruptedAtShutdown', 11602: 'InterruptedDueToReplStateChange',
    13435: 'NotPrimaryNoSecondaryOk', 13436: 'NotPrimaryOrSecondary', 40415: 'Location40415',
    13113: 'MergeStageNoMatchingDocument',
}


def code_name(code):
    return CODE_NAMES.get(code, 'Location%d' % code)


def fail(code, msg):
    """Raise a MongoDB error with the given code."""
    raise OperationFailure(msg, code)


class CommandError(Exception):
    def __init__(self, code, msg, **extra):
        Exception.__init__(self, msg)
        self.code = code
        self.msg = msg
        self.extra = extra


def error_reply(code, msg, **extra):
    doc = {'ok': 0.0, 'errmsg': msg, 'code': code, 'codeName': code_name(code)}
    doc.update(extra)
    return doc


class DupKeyError(DuplicateKeyError):
    """A duplicate key, with the index pattern and value MongoDB reports."""

    def __init__(self, msg, pattern, value):
        DuplicateKeyError.__init__(self, msg, 11000)
        self.key_pattern = pattern
        self.key_value = value

    def key_fields(self):
        if getattr(self, 'key_pattern', None) is None:
            return {}
        return {'keyPattern': self.key_pattern, 'keyValue': self.key_value}
