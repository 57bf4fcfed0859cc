/*
 * Bulk write outcomes (see include/bucketd/outcome.h for the classes). Pure: libbson only. Any
 * thread; the flusher calls it after each bulk write.
 *
 * The rules, from what may have reached the server:
 *   1. execute succeeded: every update applied.
 *   2. An update with its own writeErrors entry was executed and refused: 11000 is a duplicate
 *      (ambiguous under a write-concern error, which leaves the page's contents unconfirmed),
 *      17419/17420/10334 are sizes, transient codes are "retry", deployment codes are "config",
 *      anything else is permanent.
 *   3. Updates without an entry of their own follow the bulk's error:
 *      - server selection, a connection that could not be opened, or the driver refusing the
 *        bulk, with nothing executed: not sent (after part of the bulk ran: ambiguous);
 *      - a writeConcernErrors entry: applied on the primary but not confirmed: ambiguous;
 *      - a failure of the connection, a timeout, an unknown error, or any error after the
 *        server executed part of the bulk: ambiguous;
 *      - a RetryableWriteError label (in errorLabels or in a write-concern error): ambiguous,
 *        also next to other updates' writeErrors (a bulk the driver split into several commands
 *        can carry both, and the labelled command's updates have no entry of their own);
 *      - a command-level error from the server with nothing executed: transient code: retry;
 *        deployment code: config; otherwise refused;
 *      - only writeErrors, and the reply answers for every update (nMatched + nUpserted + the
 *        updates with an entry of their own reach the bulk's size): a partly failed unordered
 *        bulk, applied;
 *      - only writeErrors, and the reply answers for fewer updates than were sent: ambiguous.
 *        mongoc splits a bulk past maxWriteBatchSize or 48 MB into several commands and stops
 *        at the first that fails whole (refused by the server, its connection lost, refused by
 *        the driver); its reply merges what the commands before answered, and the error it
 *        returns is then the first writeErrors entry, not the failure that stopped it. Nothing
 *        says which updates without an entry ran, so none of them counts as applied.
 *   A deployment code anywhere in the answer (an update's own entry, a write-concern error, the
 *   command's error) also puts what the operator must fix into the bulk's message, which the
 *   flusher logs with its retry.
 */
#include "bucketd/outcome.h"

#include <inttypes.h>
#include <mongoc/mongoc.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/common.h"

bool bd_outcome_transient_code(int64_t code) {
    static const int64_t codes[] = {
        6,     /* HostUnreachable */
        7,     /* HostNotFound */
        50,    /* MaxTimeMSExpired */
        64,    /* WriteConcernFailed */
        89,    /* NetworkTimeout */
        91,    /* ShutdownInProgress */
        112,   /* WriteConflict */
        189,   /* PrimarySteppedDown */
        262,   /* ExceededTimeLimit */
        365,   /* TemporarilyUnavailable (e.g. the storage engine under cache pressure) */
        9001,  /* SocketException */
        10107, /* NotWritablePrimary */
        11600, /* InterruptedAtShutdown */
        11602, /* InterruptedDueToReplStateChange */
        13435, /* NotPrimaryNoSecondaryOk */
        13436, /* NotPrimaryOrSecondary */
    };
    for (size_t i = 0; i < BD_ARRAY_LEN(codes); i++) {
        if (codes[i] == code) {
            return true;
        }
    }
    return false;
}

/* Codes that name a size limit: the update or the document it produces is too large. */
static bool size_code(int64_t code) {
    return code == 17419 /* document after update over 16 MiB */ ||
           code == 17420 /* document to upsert over 16 MiB */ ||
           code == 10334 /* BSONObjectTooLarge */;
}

/*
 * Codes the deployment's set-up causes: nothing is wrong with the update, and sending it again
 * unchanged succeeds once the operator has fixed the deployment. Each code and name is in
 * MongoDB's src/mongo/base/error_codes.yml. Left out on purpose: 79 (UnknownReplWriteConcern:
 * write_concern takes no tag names), 8000 (AtlasError: Atlas's proxy, not the server, answers
 * it for unrelated refusals; it stays "refused", bounded) and 2 (BadValue, which a standalone
 * answers to a write concern w > 1 but which also refuses documents).
 */
static const struct config_error {
    int32_t code;
    const char *advice;
} config_errors[] = {
    /* Unauthorized: the user lacks an action on the namespace; a role fixes it. */
    {13, "the MongoDB user of mongodb.uri may not write to mongodb.database/collection: grant "
         "it readWrite (find, insert, update, createIndex) there"},
    /* AuthenticationFailed. */
    {18, "MongoDB refused the credentials of mongodb.uri: fix the user name, password or "
         "authSource"},
    /* ShardKeyNotFound: mongos targets an upsert by the equalities its filter holds on the
     * whole shard key (src/mongo/s/collection_routing_info_targeter.cpp: "Failed to target
     * upsert by query :: could not extract exact shard key"); bucketd's filters hold _id,
     * sensor_id and bucket_start (bucket.c). */
    {61, "the collection is sharded on a key bucketd's upserts cannot target (their filters "
         "hold equalities on _id, sensor_id and bucket_start only): shard it on "
         "{sensor_id: \"hashed\"} or {sensor_id: 1, bucket_start: 1}"},
    /* UnsatisfiableWriteConcern: w counts more data-bearing members than the replica set
     * has. The server answers it as a writeConcernError after applying the write. */
    {100, "write_concern cannot be satisfied by this deployment (it counts more data-bearing "
          "members than the replica set has): lower mongodb.write_concern or use majority"},
    /* InvalidPipelineOperator: the server does not know an expression of the update pipeline
     * (src/mongo/db/pipeline/expression.cpp: "Unrecognized expression"); every value in it is
     * a $literal, so only the server's version can cause it. */
    {168, "the server does not know an operator of bucketd's update pipeline ($sortArray came "
          "in MongoDB 5.2): upgrade to MongoDB 6.0 or later"},
    /* QueryFeatureNotAllowed: an expression of the update pipeline is not allowed under the
     * deployment's featureCompatibilityVersion (same file, same place). */
    {224, "the deployment's featureCompatibilityVersion does not allow an operator of bucketd's "
          "update pipeline ($sortArray): raise it with setFeatureCompatibilityVersion"},
    /* UserWritesBlocked: writes to user collections are blocked (setUserWriteBlockMode). */
    {371, "the deployment blocks writes to user collections (setUserWriteBlockMode): lift the "
          "block"},
};

const char *bd_outcome_config_advice(int64_t code) {
    for (size_t i = 0; i < BD_ARRAY_LEN(config_errors); i++) {
        if (config_errors[i].code == code) {
            return config_errors[i].advice;
        }
    }
    return NULL;
}

const char *bd_outcome_name(enum bd_outcome o) {
    static const char *const names[] = {"applied",   "not_sent", "ambiguous", "retry", "duplicate",
                                        "too_large", "refused",  "permanent", "config"};
    return (unsigned)o < BD_ARRAY_LEN(names) ? names[o] : "?";
}

static uint32_t keep_text(struct bd_bulk_outcome *b, const char *msg) {
    size_t len = strlen(msg);
    if (b->text_len + len + 1 > sizeof(b->text)) {
        return UINT32_MAX;
    }
    uint32_t off = b->text_len;
    memcpy(b->text + off, msg, len + 1);
    b->text_len += (uint32_t)len + 1;
    return off;
}

const char *bd_outcome_message(const struct bd_bulk_outcome *bulk, const struct bd_op_outcome *op) {
    return op->msg_off == UINT32_MAX ? "" : bulk->text + op->msg_off;
}

static bool array_nonempty(const bson_t *doc, const char *key) {
    bson_iter_t it, arr;
    return doc != NULL && bson_iter_init_find(&it, doc, key) && BSON_ITER_HOLDS_ARRAY(&it) &&
           bson_iter_recurse(&it, &arr) && bson_iter_next(&arr);
}

static int64_t count_of(const bson_t *doc, const char *key) {
    bson_iter_t it;
    if (doc != NULL && bson_iter_init_find(&it, doc, key) && BSON_ITER_HOLDS_NUMBER(&it)) {
        return bson_iter_as_int64(&it);
    }
    return 0;
}

/* The first deployment code of an answer and the message that came with it. */
struct config_note {
    int64_t code;
    const char *msg;
};

static void note_config(struct config_note *cn, int64_t code, const char *msg) {
    if (cn->code == 0 && bd_outcome_config_advice(code) != NULL) {
        cn->code = code;
        cn->msg = msg;
    }
}

static bool labels_hold(bson_iter_t *it, const char *label) {
    bson_iter_t arr;
    if (!BSON_ITER_HOLDS_ARRAY(it) || !bson_iter_recurse(it, &arr)) {
        return false;
    }
    while (bson_iter_next(&arr)) {
        if (BSON_ITER_HOLDS_UTF8(&arr) && strcmp(bson_iter_utf8(&arr, NULL), label) == 0) {
            return true;
        }
    }
    return false;
}

/*
 * The RetryableWriteError label, wherever the answer carries it: the bulk reply's errorLabels
 * (where mongoc merges the labels of each command's reply), a server reply's writeConcernError,
 * or an entry of the bulk reply's writeConcernErrors (mongoc copies each writeConcernError there
 * whole, labels included).
 */
static bool retryable_label(const bson_t *reply) {
    static const char label[] = "RetryableWriteError";
    bson_iter_t it, arr, wce;
    if (reply == NULL) {
        return false;
    }
    if (bson_iter_init_find(&it, reply, "errorLabels") && labels_hold(&it, label)) {
        return true;
    }
    if (bson_iter_init_find(&it, reply, "writeConcernError") && BSON_ITER_HOLDS_DOCUMENT(&it) &&
        bson_iter_recurse(&it, &wce) && bson_iter_find(&wce, "errorLabels") &&
        labels_hold(&wce, label)) {
        return true;
    }
    if (!bson_iter_init_find(&it, reply, "writeConcernErrors") || !BSON_ITER_HOLDS_ARRAY(&it) ||
        !bson_iter_recurse(&it, &arr)) {
        return false;
    }
    while (bson_iter_next(&arr)) {
        if (BSON_ITER_HOLDS_DOCUMENT(&arr) && bson_iter_recurse(&arr, &wce) &&
            bson_iter_find(&wce, "errorLabels") && labels_hold(&wce, label)) {
            return true;
        }
    }
    return false;
}

/* Note a deployment code among the writeConcernErrors entries. */
static void write_concern_config(const bson_t *reply, struct config_note *cn) {
    bson_iter_t it, arr, wce;
    if (reply == NULL || !bson_iter_init_find(&it, reply, "writeConcernErrors") ||
        !BSON_ITER_HOLDS_ARRAY(&it) || !bson_iter_recurse(&it, &arr)) {
        return;
    }
    while (bson_iter_next(&arr)) {
        int64_t code = 0;
        const char *msg = "";
        if (!BSON_ITER_HOLDS_DOCUMENT(&arr) || !bson_iter_recurse(&arr, &wce)) {
            continue;
        }
        while (bson_iter_next(&wce)) {
            if (strcmp(bson_iter_key(&wce), "code") == 0 && BSON_ITER_HOLDS_NUMBER(&wce)) {
                code = bson_iter_as_int64(&wce);
            } else if (strcmp(bson_iter_key(&wce), "errmsg") == 0 && BSON_ITER_HOLDS_UTF8(&wce)) {
                msg = bson_iter_utf8(&wce, NULL);
            }
        }
        note_config(cn, code, msg);
    }
}

/* "<advice>; MongoDB answered code N: <its message>" in place of the bulk's message. */
static void explain_config(struct bd_bulk_outcome *b, const struct config_note *cn) {
    if (cn->code == 0) {
        return;
    }
    /* cn->msg points into the reply or the bson_error_t, never into b->message. */
    b->config_code = (int32_t)cn->code;
    int n = snprintf(b->message, sizeof(b->message), "%s; MongoDB answered code %" PRId32 ": ",
                     bd_outcome_config_advice(cn->code), b->config_code);
    if (n > 0 && (size_t)n < sizeof(b->message)) {
        /* Cut to fit: the advice comes first because it matters most. */
        snprintf(b->message + n, sizeof(b->message) - (size_t)n, "%s", cn->msg);
    }
}

/* Updates the reply answers for: executed (matched or upserted) or with an entry of their own. */
static uint32_t answered(const bson_t *reply, const bool *has_own, uint32_t n_ops) {
    int64_t n =
        count_of(reply, "nMatched") + count_of(reply, "nUpserted") + count_of(reply, "nInserted");
    for (uint32_t i = 0; i < n_ops; i++) {
        n += has_own[i];
    }
    return (uint32_t)BD_MIN((int64_t)n_ops, BD_MAX(n, 0));
}

/*
 * The bulk's message is then an update's own refusal (mongoc's first writeErrors entry), which
 * does not tell that the bulk stopped short: add that, cut to fit.
 */
static void note_unanswered(struct bd_bulk_outcome *b, uint32_t answered_n, uint32_t n_ops) {
    size_t len = strlen(b->message);
    snprintf(b->message + len, sizeof(b->message) - len,
             "; no answer for %" PRIu32 " of %" PRIu32
             " updates (the driver stopped the bulk, split into commands, at one that failed)",
             n_ops - answered_n, n_ops);
}

/* Walk writeErrors: set the outcome of each update that has an entry; true if any had one. */
static bool own_errors(const bson_t *reply, uint32_t n_ops, struct bd_op_outcome *ops,
                       bool *has_own, struct bd_bulk_outcome *bulk, struct config_note *cn) {
    bson_iter_t it, arr;
    bool any = false;
    if (reply == NULL || !bson_iter_init_find(&it, reply, "writeErrors") ||
        !BSON_ITER_HOLDS_ARRAY(&it) || !bson_iter_recurse(&it, &arr)) {
        return false;
    }
    while (bson_iter_next(&arr)) {
        bson_iter_t e;
        int64_t index = -1, code = 0;
        const char *msg = "";
        if (!BSON_ITER_HOLDS_DOCUMENT(&arr) || !bson_iter_recurse(&arr, &e)) {
            continue;
        }
        while (bson_iter_next(&e)) {
            const char *k = bson_iter_key(&e);
            if (strcmp(k, "index") == 0 && BSON_ITER_HOLDS_NUMBER(&e)) {
                index = bson_iter_as_int64(&e);
            } else if (strcmp(k, "code") == 0 && BSON_ITER_HOLDS_NUMBER(&e)) {
                code = bson_iter_as_int64(&e);
            } else if (strcmp(k, "errmsg") == 0 && BSON_ITER_HOLDS_UTF8(&e)) {
                msg = bson_iter_utf8(&e, NULL);
            }
        }
        if (index < 0 || (uint64_t)index >= n_ops) {
            continue; /* not ours to judge: the rest of the bulk decides */
        }
        struct bd_op_outcome *op = &ops[index];
        any = true;
        has_own[index] = true;
        op->code = (int32_t)BD_MAX(BD_MIN(code, INT32_MAX), INT32_MIN);
        op->msg_off = keep_text(bulk, msg);
        if (code == 11000) {
            op->kind = BD_OUTCOME_DUPLICATE;
        } else if (size_code(code)) {
            op->kind = BD_OUTCOME_TOO_LARGE;
        } else if (bd_outcome_transient_code(code)) {
            op->kind = BD_OUTCOME_RETRY;
        } else if (bd_outcome_config_advice(code) != NULL) {
            op->kind = BD_OUTCOME_CONFIG;
            note_config(cn, code, msg);
        } else if (code == 8000) {
            /* AtlasError: Atlas's proxy refuses for reasons of its own (plan limits, quotas);
             * some pass, so a few more attempts before the update is quarantined. */
            op->kind = BD_OUTCOME_REFUSED;
        } else {
            op->kind = BD_OUTCOME_PERMANENT;
        }
    }
    return any;
}

static bool not_connected(const bson_error_t *e) {
    return e->domain == MONGOC_ERROR_SERVER_SELECTION ||
           (e->domain == MONGOC_ERROR_STREAM && (e->code == MONGOC_ERROR_STREAM_CONNECT ||
                                                 e->code == MONGOC_ERROR_STREAM_NAME_RESOLUTION));
}

static bool client_refusal(const bson_error_t *e) {
    return e->domain == MONGOC_ERROR_BSON ||
           (e->domain == MONGOC_ERROR_COMMAND && e->code == MONGOC_ERROR_COMMAND_INVALID_ARG);
}

static bool server_error(const bson_error_t *e) {
    return e->domain == MONGOC_ERROR_SERVER || e->domain == MONGOC_ERROR_WRITE_CONCERN ||
           e->domain == MONGOC_ERROR_QUERY;
}

void bd_outcome_classify(bool ok, const bson_t *reply, const bson_error_t *error, uint32_t n_ops,
                         struct bd_op_outcome *ops, struct bd_bulk_outcome *bulk) {
    memset(bulk, 0, sizeof(*bulk));
    for (uint32_t i = 0; i < n_ops; i++) {
        ops[i] = (struct bd_op_outcome){.kind = BD_OUTCOME_APPLIED, .msg_off = UINT32_MAX};
    }
    if (ok) {
        bulk->cause = BD_CAUSE_NONE;
        bulk->reached = n_ops;
        return;
    }
    bulk->code = error->code;
    snprintf(bulk->message, sizeof(bulk->message), "%s", error->message);
    bulk->write_concern = array_nonempty(reply, "writeConcernErrors");
    bulk->partly_executed = count_of(reply, "nInserted") + count_of(reply, "nMatched") +
                                count_of(reply, "nModified") + count_of(reply, "nUpserted") +
                                count_of(reply, "nRemoved") >
                            0;
    bulk->reached = n_ops;

    /* has_own marks the updates judged by their own writeErrors entry. */
    bool has_own_small[64];
    bool *has_own = has_own_small;
    if (n_ops > BD_ARRAY_LEN(has_own_small)) {
        has_own = bd_calloc(n_ops, sizeof(*has_own));
    } else {
        memset(has_own, 0, sizeof(has_own_small));
    }
    if (has_own == NULL) {
        /* Out of memory: nothing can be judged, so nothing is taken as settled. */
        bulk->cause = BD_CAUSE_CONNECTION;
        bulk->reached = not_connected(error) || client_refusal(error) ? 0 : n_ops;
        for (uint32_t i = 0; i < n_ops; i++) {
            ops[i].kind = BD_OUTCOME_AMBIGUOUS;
        }
        return;
    }
    struct config_note cn = {0};
    bool any_own = own_errors(reply, n_ops, ops, has_own, bulk, &cn);
    if (bulk->write_concern) {
        /* The page holds the update (the duplicate key says so), but the write concern did not
         * confirm it: it may still be rolled back. Sent again until an answer confirms it. */
        for (uint32_t i = 0; i < n_ops; i++) {
            if (has_own[i] && ops[i].kind == BD_OUTCOME_DUPLICATE) {
                ops[i].kind = BD_OUTCOME_AMBIGUOUS;
            }
        }
    }
    write_concern_config(reply, &cn);
    bool labelled = retryable_label(reply);

    enum bd_outcome rest;
    if (not_connected(error) || client_refusal(error)) {
        /* A bulk the driver split into several commands may fail to reach a server, or be
         * refused by the driver, after an earlier command of it was executed: then nothing
         * says which updates ran, only how many the server answered for. */
        bulk->cause = not_connected(error) ? BD_CAUSE_UNREACHABLE : BD_CAUSE_CLIENT;
        rest = bulk->partly_executed || any_own ? BD_OUTCOME_AMBIGUOUS : BD_OUTCOME_NOT_SENT;
        bulk->reached = answered(reply, has_own, n_ops);
    } else if (!server_error(error)) {
        bulk->cause = BD_CAUSE_CONNECTION;
        rest = BD_OUTCOME_AMBIGUOUS;
    } else if (bulk->write_concern || labelled) {
        bulk->cause = BD_CAUSE_SERVER;
        rest = BD_OUTCOME_AMBIGUOUS;
        note_config(&cn, error->code, error->message);
    } else if (any_own) {
        /* The error is the first writeErrors entry, whatever stopped a split bulk (see the
         * rules above): only the counts tell a partly failed bulk from an unfinished one. An
         * unfinished one counts as sent whole, as after a failed connection: what stopped it
         * is unknown. */
        bulk->cause = BD_CAUSE_SERVER;
        uint32_t answered_n = answered(reply, has_own, n_ops);
        rest = BD_OUTCOME_APPLIED;
        if (answered_n < n_ops) {
            rest = BD_OUTCOME_AMBIGUOUS;
            note_unanswered(bulk, answered_n, n_ops);
        }
    } else {
        bulk->cause = BD_CAUSE_SERVER;
        note_config(&cn, error->code, error->message);
        if (bulk->partly_executed) {
            rest = BD_OUTCOME_AMBIGUOUS;
        } else if (bd_outcome_transient_code(error->code)) {
            rest = BD_OUTCOME_RETRY;
        } else if (bd_outcome_config_advice(error->code) != NULL) {
            rest = BD_OUTCOME_CONFIG;
        } else {
            rest = BD_OUTCOME_REFUSED;
        }
    }
    for (uint32_t i = 0; i < n_ops; i++) {
        if (!has_own[i]) {
            ops[i].kind = (uint8_t)rest;
        }
    }
    if (has_own != has_own_small) {
        free(has_own);
    }
    explain_config(bulk, &cn);
}
