/*
 * Bulk write outcomes (see include/bucketd/outcome.h for the classes). Pure: libbson only. Any
 * thread; the flusher calls it after each bulk write.
 *
 * The rules, from what may have reached the server:
 *   1. execute succeeded: every update applied.
 *   2. An update with its own writeErrors entry was executed and refused: 11000 is a duplicate,
 *      17419/17420/10334 are sizes, transient codes are "retry", configuration codes are
 *      "refused", anything else is permanent.
 *   3. Updates without an entry of their own follow the bulk's error:
 *      - server selection, a connection that could not be opened, or the driver refusing the
 *        bulk, with nothing executed: not sent (after part of the bulk ran: ambiguous);
 *      - a writeConcernErrors entry: applied on the primary but not confirmed: ambiguous;
 *      - a failure of the connection, a timeout, an unknown error, or any error after the
 *        server executed part of the bulk: ambiguous;
 *      - a command-level error from the server with nothing executed: RetryableWriteError label:
 *        ambiguous; transient code: retry; otherwise refused;
 *      - only writeErrors (a partly failed unordered bulk): applied.
 */
#include "bucketd/outcome.h"

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
        365,   /* TenantMigrationAborted */
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

/* Codes that the deployment's configuration causes and may stop causing: retried, bounded. */
static bool config_code(int64_t code) {
    return code == 13 /* Unauthorized */ || code == 18 /* AuthenticationFailed */ ||
           code == 61 /* ShardKeyNotFound */ || code == 8000 /* AtlasError */;
}

const char *bd_outcome_name(enum bd_outcome o) {
    static const char *const names[] = {"applied",   "not_sent",  "ambiguous", "retry",
                                        "duplicate", "too_large", "refused",   "permanent"};
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

/* Walk writeErrors: set the outcome of each update that has an entry; true if any had one. */
static bool own_errors(const bson_t *reply, uint32_t n_ops, struct bd_op_outcome *ops,
                       bool *has_own, struct bd_bulk_outcome *bulk) {
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
        } else if (config_code(code)) {
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
        return;
    }
    bulk->code = error->code;
    snprintf(bulk->message, sizeof(bulk->message), "%s", error->message);
    bulk->write_concern = array_nonempty(reply, "writeConcernErrors");
    bulk->partly_executed = count_of(reply, "nInserted") + count_of(reply, "nMatched") +
                                count_of(reply, "nModified") + count_of(reply, "nUpserted") +
                                count_of(reply, "nRemoved") >
                            0;

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
        for (uint32_t i = 0; i < n_ops; i++) {
            ops[i].kind = BD_OUTCOME_AMBIGUOUS;
        }
        return;
    }
    bool any_own = own_errors(reply, n_ops, ops, has_own, bulk);

    enum bd_outcome rest;
    if (not_connected(error)) {
        /* A bulk the driver split into several commands may fail to reach a server after an
         * earlier command of it was executed: then nothing says which updates ran. */
        bulk->cause = BD_CAUSE_UNREACHABLE;
        rest = bulk->partly_executed || any_own ? BD_OUTCOME_AMBIGUOUS : BD_OUTCOME_NOT_SENT;
    } else if (client_refusal(error)) {
        bulk->cause = BD_CAUSE_CLIENT;
        rest = bulk->partly_executed || any_own ? BD_OUTCOME_AMBIGUOUS : BD_OUTCOME_NOT_SENT;
    } else if (!server_error(error)) {
        bulk->cause = BD_CAUSE_CONNECTION;
        rest = BD_OUTCOME_AMBIGUOUS;
    } else if (bulk->write_concern) {
        bulk->cause = BD_CAUSE_SERVER;
        rest = BD_OUTCOME_AMBIGUOUS;
    } else if (any_own) {
        bulk->cause = BD_CAUSE_SERVER;
        rest = BD_OUTCOME_APPLIED;
    } else {
        bulk->cause = BD_CAUSE_SERVER;
        if (bulk->partly_executed ||
            (reply != NULL && mongoc_error_has_label(reply, "RetryableWriteError"))) {
            rest = BD_OUTCOME_AMBIGUOUS;
        } else if (bd_outcome_transient_code(error->code)) {
            rest = BD_OUTCOME_RETRY;
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
}
