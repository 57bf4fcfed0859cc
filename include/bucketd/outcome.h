/*
 * What became of each update of a bulk write: a pure function from the driver's answer (the
 * bulk reply and bson_error_t of mongoc_bulk_operation_execute, error API 2) to one outcome per
 * update, judged by what may have reached the server. libbson only: no client, no thread, no
 * clock, so unit tests feed it every reply shape.
 *
 *   applied     acknowledged.
 *   not_sent    never reached the server (server selection failed, the connection could not be
 *               opened, the driver refused the bulk before sending it): send again, as is.
 *   ambiguous   may have been applied (connection lost mid-request, no reply, a write-concern
 *               error, an error labelled RetryableWriteError, a bulk the driver split whose reply
 *               answers for fewer updates than were sent): send again as is; a duplicate-key
 *               answer then needs the page read back before it counts as applied. Under a
 *               write-concern error a duplicate-key answer is ambiguous too: the page holds the
 *               update, but the write concern has not confirmed it.
 *   retry       refused for now by the server with a transient code (not applied): send again.
 *   duplicate   11000: our earlier attempt applied it, another writer's insert raced ours, or
 *               another daemon uses this writer_id: the flusher reads the page back to decide.
 *   too_large   the update or the document it would produce is over MongoDB's size limit:
 *               the flusher moves its readings to new pages (splitting them) and sends again.
 *   refused     refused by the server for the whole command with a code of no known class (or
 *               Atlas's own 8000): sent again a bounded number of times, then quarantined.
 *   permanent   refused for this document for good (e.g. a validator): quarantined at once.
 *   config      not applied because of how the deployment is set up (see
 *               bd_outcome_config_advice): nothing is wrong with the update, the operator must
 *               fix the deployment. Sent again with the normal backoff, never quarantined; the
 *               bulk's message says what to fix.
 */
#ifndef BUCKETD_OUTCOME_H
#define BUCKETD_OUTCOME_H

#include <bson/bson.h>
#include <stdbool.h>
#include <stdint.h>

enum bd_outcome {
    BD_OUTCOME_APPLIED,
    BD_OUTCOME_NOT_SENT,
    BD_OUTCOME_AMBIGUOUS,
    BD_OUTCOME_RETRY,
    BD_OUTCOME_DUPLICATE,
    BD_OUTCOME_TOO_LARGE,
    BD_OUTCOME_REFUSED,
    BD_OUTCOME_PERMANENT,
    BD_OUTCOME_CONFIG,
};

/* Why a bulk did not fully succeed, for logs and the stop message. */
enum bd_bulk_cause {
    BD_CAUSE_NONE,        /* every update applied */
    BD_CAUSE_UNREACHABLE, /* no server could be selected or connected to */
    BD_CAUSE_CONNECTION,  /* the connection failed during the request */
    BD_CAUSE_CLIENT,      /* the driver refused the bulk before sending it */
    BD_CAUSE_SERVER,      /* the server answered with errors */
};

struct bd_op_outcome {
    uint8_t kind;     /* enum bd_outcome */
    int32_t code;     /* the server's code for this update (0: none of its own) */
    uint32_t msg_off; /* offset of its message in the bulk outcome's text (UINT32_MAX: none) */
};

struct bd_bulk_outcome {
    enum bd_bulk_cause cause;
    int64_t code;         /* the top-level code (driver or server), 0 if none */
    bool write_concern;   /* the reply carried writeConcernErrors */
    bool partly_executed; /* the reply counts updates the server executed */
    /* Updates known to have reached the server (updates_sent): all of them unless nothing was
     * sent (no server, the driver's refusal), then those the reply counts as executed. */
    uint32_t reached;
    int32_t config_code; /* a deployment error's code found anywhere in the answer (0: none) */
    /* The top-level message; with config_code, "<advice>; MongoDB answered code N: <message>". */
    char message[512];
    char text[2048]; /* per-update messages, NUL-separated, truncated when full */
    uint32_t text_len;
};

/*
 * Classify one bulk of n_ops updates. ok is execute's return value; reply and error as execute
 * filled them (error is ignored when ok). ops[0..n_ops) receives one outcome each.
 */
void bd_outcome_classify(bool ok, const bson_t *reply, const bson_error_t *error, uint32_t n_ops,
                         struct bd_op_outcome *ops, struct bd_bulk_outcome *bulk);

/* The message of one update ("" if none). */
const char *bd_outcome_message(const struct bd_bulk_outcome *bulk, const struct bd_op_outcome *op);

/* Server codes that mean "not now" rather than "never" (exposed for tests). */
bool bd_outcome_transient_code(int64_t code);

/*
 * For a code the deployment's set-up causes (a shard key upserts cannot target, a write concern
 * it cannot satisfy, missing privileges, a server too old for the update pipeline, ...): what
 * the operator must fix, as a sentence for the log. NULL for any other code.
 */
const char *bd_outcome_config_advice(int64_t code);

const char *bd_outcome_name(enum bd_outcome o);

#endif
