/*
 * Bulk write outcomes (src/outcome.c): every reply shape the driver can hand back, one row each.
 * A row is the driver's answer (execute's return value, the reply as extended JSON, the
 * bson_error_t) and what each update of the bulk must become, written as one letter per update:
 *
 *   A applied   N not_sent   ? ambiguous   R retry   D duplicate   L too_large
 *   F refused (bounded retries)   P permanent   C config (the deployment must be fixed)
 *
 * The rules are those of src/outcome.c's header comment; the row names say which one is tested.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <mongoc/mongoc.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/common.h"
#include "bucketd/alloc.h"
#include "bucketd/outcome.h"

static const char kind_letters[] = "AN?RDLFPC";

struct row {
    const char *name;
    bool ok;
    const char *reply; /* extended JSON; NULL: no reply document at all */
    uint32_t domain, code;
    const char *message;
    const char *expect; /* one letter per update: the bulk has strlen(expect) updates */
    enum bd_bulk_cause cause;
    int32_t codes[5]; /* the code each update carries (0: none of its own) */
    bool write_concern, partly;
    int32_t config;          /* the deployment code the bulk must name (0: none) */
    const char *message_out; /* the bulk's message when it is not the error's (NULL: it is) */
};

/* Flags of a row: the reply carries writeConcernErrors; it counts executed updates. */
#define WC 1
#define PARTLY 2

/* A failed bulk; the trailing arguments are the codes of its updates, from the first. */
#define ROW(name_, reply_, domain_, code_, message_, expect_, cause_, flags_, ...)                 \
    {                                                                                              \
        .name = (name_), .ok = false, .reply = (reply_), .domain = (domain_), .code = (code_),     \
        .message = (message_), .expect = (expect_), .cause = (cause_), .codes = {__VA_ARGS__},     \
        .write_concern = ((flags_)&WC) != 0, .partly = ((flags_)&PARTLY) != 0                      \
    }

/* A failed bulk whose answer holds deployment code config_: its message must name the fix. */
#define CROW(name_, reply_, domain_, code_, message_, expect_, cause_, flags_, config_, ...)       \
    {                                                                                              \
        .name = (name_), .ok = false, .reply = (reply_), .domain = (domain_), .code = (code_),     \
        .message = (message_), .expect = (expect_), .cause = (cause_), .codes = {__VA_ARGS__},     \
        .write_concern = ((flags_)&WC) != 0, .partly = ((flags_)&PARTLY) != 0, .config = (config_) \
    }

/* A failed bulk of a server error whose bulk message is message_out. */
#define MROW(name_, reply_, code_, message_, expect_, flags_, message_out_, ...)                   \
    {                                                                                              \
        .name = (name_), .ok = false, .reply = (reply_), .domain = MONGOC_ERROR_SERVER,            \
        .code = (code_), .message = (message_), .expect = (expect_), .cause = BD_CAUSE_SERVER,     \
        .codes = {__VA_ARGS__}, .write_concern = ((flags_)&WC) != 0,                               \
        .partly = ((flags_)&PARTLY) != 0, .message_out = (message_out_)                            \
    }

/* What the bulk's message says of a split bulk that stopped short. */
#define UNANSWERED(n_, of_)                                                                        \
    "; no answer for " #n_ " of " #of_ " updates (the driver stopped the bulk, split into "        \
    "commands, at one that failed)"

/* A bulk that succeeded; the error is whatever execute left there, to be ignored. */
#define OK_ROW(name_, reply_, domain_, code_, message_, expect_)                                   \
    {                                                                                              \
        .name = (name_), .ok = true, .reply = (reply_), .domain = (domain_), .code = (code_),      \
        .message = (message_), .expect = (expect_), .cause = BD_CAUSE_NONE                         \
    }

static bson_t *reply_of(const char *json) {
    bson_error_t err;
    if (json == NULL) {
        return NULL;
    }
    bson_t *b = bson_new_from_json((const uint8_t *)json, -1, &err);
    cr_assert_not_null(b, "bad reply JSON %s: %s", json, err.message);
    return b;
}

static void error_of(bson_error_t *e, uint32_t domain, uint32_t code, const char *msg) {
    memset(e, 0, sizeof(*e));
    e->domain = domain;
    e->code = code;
    snprintf(e->message, sizeof(e->message), "%s", msg != NULL ? msg : "");
}

/* The outcome vector as letters, to compare whole rows in one readable assertion. */
static void letters(const struct bd_op_outcome *ops, uint32_t n, char *out) {
    for (uint32_t i = 0; i < n; i++) {
        out[i] = ops[i].kind < sizeof(kind_letters) - 1 ? kind_letters[ops[i].kind] : '#';
    }
    out[n] = '\0';
}

static void check_row(const struct row *r) {
    const uint32_t n = (uint32_t)strlen(r->expect);
    cr_assert_leq(n, BD_ARRAY_LEN(r->codes), "%s: too many updates for the table", r->name);
    struct bd_op_outcome ops[BD_ARRAY_LEN(r->codes)];
    struct bd_bulk_outcome bulk;
    bson_error_t err;
    bson_t *reply = reply_of(r->reply);
    error_of(&err, r->domain, r->code, r->message);
    /* Garbage first: the classifier must set every field itself. */
    memset(ops, 0xa5, sizeof(ops));
    memset(&bulk, 0xa5, sizeof(bulk));

    bd_outcome_classify(r->ok, reply, &err, n, ops, &bulk);

    char got[BD_ARRAY_LEN(r->codes) + 1];
    letters(ops, n, got);
    cr_expect_str_eq(got, r->expect, "%s: outcomes %s, expected %s", r->name, got, r->expect);
    cr_expect_eq(bulk.cause, r->cause, "%s: cause %d, expected %d", r->name, bulk.cause, r->cause);
    cr_expect_eq(bulk.write_concern, r->write_concern, "%s: write_concern", r->name);
    cr_expect_eq(bulk.partly_executed, r->partly, "%s: partly_executed", r->name);
    cr_expect_eq(bulk.code, r->ok ? 0 : (int64_t)r->code, "%s: top-level code", r->name);
    cr_expect_eq(bulk.config_code, r->config, "%s: config code %d, expected %d", r->name,
                 bulk.config_code, r->config);
    if (r->message_out != NULL) {
        cr_expect_str_eq(bulk.message, r->message_out, "%s: message", r->name);
    } else if (r->config == 0) {
        cr_expect_str_eq(bulk.message, r->ok || r->message == NULL ? "" : r->message, "%s: message",
                         r->name);
    } else {
        /* What follows is the message that came with the code (see config_messages). */
        char want[sizeof(bulk.message)];
        snprintf(want, sizeof(want),
                 "%s; MongoDB answered code %d: ", bd_outcome_config_advice(r->config), r->config);
        cr_expect_eq(strncmp(bulk.message, want, strlen(want)), 0,
                     "%s: message \"%s\" does not start \"%s\"", r->name, bulk.message, want);
    }
    cr_expect_leq(bulk.text_len, sizeof(bulk.text), "%s: text_len", r->name);
    for (uint32_t i = 0; i < n; i++) {
        cr_expect_eq(ops[i].code, r->codes[i], "%s: update %u has code %d, expected %d", r->name, i,
                     ops[i].code, r->codes[i]);
        if (r->codes[i] == 0) {
            cr_expect_str_eq(bd_outcome_message(&bulk, &ops[i]), "", "%s: update %u", r->name, i);
        }
    }
    bson_destroy(reply);
}

static void check_rows(const struct row *rows, size_t n) {
    for (size_t i = 0; i < n; i++) {
        check_row(&rows[i]);
    }
}

#define SERVER MONGOC_ERROR_SERVER
#define DUP_MSG "E11000 duplicate key error collection: db.c index: _id_"

TestSuite(outcome);

/* Rule 1. */
Test(outcome, success_applies_everything) {
    static const struct row rows[] = {
        OK_ROW("ok", "{\"nMatched\": 2, \"nModified\": 2, \"nUpserted\": 1}", 0, 0, NULL, "AAA"),
        OK_ROW("ok, empty reply", "{}", 0, 0, NULL, "AAAAA"),
        /* error is ignored when ok: whatever it holds, the bulk succeeded. */
        OK_ROW("ok, stale error", "{\"nMatched\": 1}", MONGOC_ERROR_STREAM,
               MONGOC_ERROR_STREAM_SOCKET, "stale", "A"),
        OK_ROW("ok, no updates", "{}", 0, 0, NULL, ""),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

Test(outcome, success_needs_no_reply_nor_error) {
    struct bd_op_outcome ops[2];
    struct bd_bulk_outcome bulk;
    memset(&bulk, 0xa5, sizeof(bulk));
    bd_outcome_classify(true, NULL, NULL, 2, ops, &bulk);
    cr_assert_eq(ops[0].kind, BD_OUTCOME_APPLIED);
    cr_assert_eq(ops[1].kind, BD_OUTCOME_APPLIED);
    cr_assert_eq(bulk.cause, BD_CAUSE_NONE);
    cr_assert_eq(bulk.code, 0);
    cr_assert_eq(bulk.text_len, 0);
    cr_assert_str_eq(bulk.message, "");
}

/*
 * Rule 2 and the last case of rule 3: an unordered bulk where some updates were refused by the
 * server, each by its own writeErrors entry; the others were applied.
 */
Test(outcome, partial_failure_of_an_unordered_bulk) {
    static const struct row rows[] = {
        ROW("11000 at 1 of 3",
            "{\"nMatched\": 2, \"nModified\": 2, \"writeErrors\": [{\"index\": 1, \"code\": 11000, "
            "\"errmsg\": \"" DUP_MSG "\"}]}",
            SERVER, 11000, DUP_MSG, "ADA", BD_CAUSE_SERVER, PARTLY, 0, 11000, 0),
        ROW("17419 at 0 of 4",
            "{\"nMatched\": 3, \"writeErrors\": [{\"index\": 0, \"code\": 17419, \"errmsg\": "
            "\"Resulting document after update is larger than 16777216\"}]}",
            SERVER, 17419, "Resulting document after update is larger than 16777216", "LAAA",
            BD_CAUSE_SERVER, PARTLY, 17419),
        ROW("17420 at 3 of 4",
            "{\"nUpserted\": 3, \"writeErrors\": [{\"index\": 3, \"code\": 17420, \"errmsg\": "
            "\"Document to upsert is larger than 16777216\"}]}",
            SERVER, 17420, "Document to upsert is larger than 16777216", "AAAL", BD_CAUSE_SERVER,
            PARTLY, 0, 0, 0, 17420),
        ROW("10334 at 2 of 5",
            "{\"nMatched\": 4, \"writeErrors\": [{\"index\": 2, \"code\": 10334, \"errmsg\": "
            "\"BSONObj size: 16793600 (0x1004000) is invalid\"}]}",
            SERVER, 10334, "BSONObj size: 16793600 (0x1004000) is invalid", "AALAA",
            BD_CAUSE_SERVER, PARTLY, 0, 0, 10334),
        CROW("61 at 4 of 5",
             "{\"nMatched\": 4, \"writeErrors\": [{\"index\": 4, \"code\": 61, \"errmsg\": "
             "\"Failed to target upsert by query :: could not extract exact shard key\"}]}",
             SERVER, 61, "Failed to target upsert by query :: could not extract exact shard key",
             "AAAAC", BD_CAUSE_SERVER, PARTLY, 61, 0, 0, 0, 0, 61),
        CROW("13 at 0 of 3",
             "{\"nMatched\": 2, \"writeErrors\": [{\"index\": 0, \"code\": 13, \"errmsg\": \"not "
             "authorized on db to execute command\"}]}",
             SERVER, 13, "not authorized on db to execute command", "CAA", BD_CAUSE_SERVER, PARTLY,
             13, 13),
        /* 8000 is Atlas's proxy answering for many reasons: bounded retries, then quarantine. */
        CROW("18 is a deployment code, 8000 is refused",
             "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 18}, {\"index\": 2, "
             "\"code\": 8000}]}",
             SERVER, 18, "Authentication failed.", "CAF", BD_CAUSE_SERVER, PARTLY, 18, 18, 0, 8000),
        ROW("2 at 1 of 3",
            "{\"nMatched\": 2, \"writeErrors\": [{\"index\": 1, \"code\": 2, \"errmsg\": "
            "\"bad\"}]}",
            SERVER, 2, "bad", "APA", BD_CAUSE_SERVER, PARTLY, 0, 2, 0),
        ROW("121 at 2 of 3",
            "{\"nMatched\": 2, \"writeErrors\": [{\"index\": 2, \"code\": 121, \"errmsg\": "
            "\"Document failed validation\", \"errInfo\": {\"failingDocumentId\": \"x\"}}]}",
            SERVER, 121, "Document failed validation", "AAP", BD_CAUSE_SERVER, PARTLY, 0, 0, 121),
        CROW("every class in one bulk of 5",
             "{\"nMatched\": 0, \"writeErrors\": [{\"index\": 4, \"code\": 121}, {\"index\": 3, "
             "\"code\": 13}, {\"index\": 2, \"code\": 91}, {\"index\": 1, \"code\": 17419}, "
             "{\"index\": 0, \"code\": 11000}]}",
             SERVER, 121, "Document failed validation", "DLRCP", BD_CAUSE_SERVER, 0, 13, 11000,
             17419, 91, 13, 121),
        /* mongoc always counts what an acknowledged bulk executed: a reply without counts
         * answers for no update but those with an entry of their own. */
        MROW("own errors without counts: the others are not known to be applied",
             "{\"writeErrors\": [{\"index\": 1, \"code\": 11000}]}", 11000, DUP_MSG, "?D??", 0,
             DUP_MSG UNANSWERED(3, 4), 0, 11000),
        ROW("own errors in the legacy query domain",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 11000}]}",
            MONGOC_ERROR_QUERY, 11000, DUP_MSG, "DA", BD_CAUSE_SERVER, PARTLY, 11000),
        ROW("a code of no known class is permanent",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 1, \"code\": 52}]}", SERVER, 52,
            "$-prefixed field", "AP", BD_CAUSE_SERVER, PARTLY, 0, 52),
        ROW("an entry without a code is permanent",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 1}]}", SERVER, 1, "?", "AP",
            BD_CAUSE_SERVER, PARTLY, 0, 0),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/*
 * A bulk the driver split into several commands (past maxWriteBatchSize or 48 MB), one of which
 * answered writeErrors and a later one failed whole: the server refused it (11600, 13), or the
 * connection failed. mongoc stops there, and its reply merges what the commands before
 * answered: counts, upserted[] and writeErrors with indexes into the whole bulk. The error it
 * returns is the first writeErrors entry, in the server domain: the failure that stopped the
 * bulk is nowhere in the answer. Only the counts show it: the updates the reply answers for
 * (nMatched + nUpserted + those with an entry of their own) are fewer than those sent, and
 * nothing says which of the updates without an entry ran, so none of them is applied: each is
 * ambiguous (sent again under the same number; the filter keeps it from applying twice).
 */
Test(outcome, split_bulk_with_unanswered_updates) {
    static const struct row rows[] = {
        /* maxWriteBatchSize 2: [0 duplicate, 1 upserted], then 11600 for [2, 3]; the reply and
         * error of libmongoc 1.23.1 against the test server, as they came. */
        MROW("11600 on the second command after an 11000 in the first",
             "{\"nInserted\": 0, \"nMatched\": 0, \"nModified\": 0, \"nRemoved\": 0, "
             "\"nUpserted\": 1, \"upserted\": [{\"index\": 1, \"_id\": 1}], \"writeErrors\": "
             "[{\"index\": 0, \"code\": 11000, \"errmsg\": \"" DUP_MSG "\", \"keyPattern\": "
             "{\"_id\": 1}, \"keyValue\": {\"_id\": 0}}]}",
             11000, DUP_MSG, "D???", PARTLY, DUP_MSG UNANSWERED(2, 4), 11000),
        /* [0 matched, 1 duplicate], then the connection failed sending [2, 3], [4]. */
        MROW("a connection lost on the second command after an 11000 in the first",
             "{\"nInserted\": 0, \"nMatched\": 1, \"nModified\": 1, \"nRemoved\": 0, "
             "\"nUpserted\": 0, \"writeErrors\": [{\"index\": 1, \"code\": 11000, \"errmsg\": "
             "\"" DUP_MSG "\"}]}",
             11000, DUP_MSG, "?D???", PARTLY, DUP_MSG UNANSWERED(3, 5), 0, 11000),
        /* [0 refused by a validator, 1 matched], then 13 for [2, 3]: neither the code nor its
         * advice is in the answer. */
        MROW("13 on the second command after a 121 in the first",
             "{\"nInserted\": 0, \"nMatched\": 1, \"nModified\": 1, \"nRemoved\": 0, "
             "\"nUpserted\": 0, \"writeErrors\": [{\"index\": 0, \"code\": 121, \"errmsg\": "
             "\"Document failed validation\"}]}",
             121, "Document failed validation", "P???", PARTLY,
             "Document failed validation" UNANSWERED(2, 4), 121),
        /* Every update of the first command refused: nothing counted as executed. */
        MROW("the first command all duplicates, the second failed",
             "{\"nInserted\": 0, \"nMatched\": 0, \"nModified\": 0, \"nRemoved\": 0, "
             "\"nUpserted\": 0, \"writeErrors\": [{\"index\": 0, \"code\": 11000}, {\"index\": "
             "1, \"code\": 11000}]}",
             11000, "Multiple write errors", "DD??", 0, "Multiple write errors" UNANSWERED(2, 4),
             11000, 11000),
        /* Three commands of two: the third failed; the own entries keep their classes. */
        MROW("the third command failed after entries in the first two",
             "{\"nInserted\": 0, \"nMatched\": 2, \"nModified\": 2, \"nRemoved\": 0, "
             "\"nUpserted\": 0, \"writeErrors\": [{\"index\": 0, \"code\": 11000}, {\"index\": "
             "3, \"code\": 17419}]}",
             11000, "Multiple write errors", "D??L?", PARTLY,
             "Multiple write errors" UNANSWERED(1, 5), 11000, 0, 0, 17419, 0),
        /* One answered short: which of the four without an entry was not answered is unknown. */
        MROW("one update short",
             "{\"nMatched\": 2, \"nUpserted\": 1, \"writeErrors\": [{\"index\": 3, \"code\": "
             "11000}]}",
             11000, DUP_MSG, "???D?", PARTLY, DUP_MSG UNANSWERED(1, 5), 0, 0, 0, 11000, 0),
        /* Counts that answer for every update: a partly failed bulk, the others applied. */
        ROW("matched, upserted and own entries answer for all",
            "{\"nMatched\": 2, \"nUpserted\": 1, \"writeErrors\": [{\"index\": 3, \"code\": "
            "11000}, {\"index\": 4, \"code\": 121}]}",
            SERVER, 11000, DUP_MSG, "AAADP", BD_CAUSE_SERVER, PARTLY, 0, 0, 0, 11000, 121),
        /* Two entries for one update answer for one update, not two. */
        MROW("an update with two entries is answered once",
             "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 11000}, {\"index\": "
             "0, \"code\": 11000}]}",
             11000, DUP_MSG, "D??", PARTLY, DUP_MSG UNANSWERED(1, 3), 11000),
        /* Entries of no update of this bulk answer for none. */
        MROW("an entry outside the bulk answers for nothing",
             "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 11000}, {\"index\": "
             "7, \"code\": 11000}]}",
             11000, DUP_MSG, "D??", PARTLY, DUP_MSG UNANSWERED(1, 3), 11000),
        /* More counted than sent (a reply not of this bulk): no update is left unanswered. */
        ROW("counts past the bulk",
            "{\"nMatched\": 5, \"writeErrors\": [{\"index\": 0, \"code\": 11000}]}", SERVER, 11000,
            DUP_MSG, "DAA", BD_CAUSE_SERVER, PARTLY, 11000),
        /* Under a write concern error the rest is ambiguous whatever the counts. */
        ROW("short counts with a write concern error",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 121}], "
            "\"writeConcernErrors\": [{\"code\": 64}]}",
            SERVER, 121, "x", "P???", BD_CAUSE_SERVER, WC | PARTLY, 121),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/* Rule 2: a writeErrors entry with a transient code is "retry", whatever its position. */
Test(outcome, transient_write_errors_retry) {
    static const int32_t codes[] = {91, 189, 10107, 11600, 11602, 13435, 13436, 365, 112};
    for (size_t c = 0; c < BD_ARRAY_LEN(codes); c++) {
        const uint32_t n = 3 + (uint32_t)(c % 3), at = (uint32_t)(c % n);
        char json[256], expect[8], name[64];
        struct row r = {.name = name,
                        .reply = json,
                        .domain = SERVER,
                        .code = (uint32_t)codes[c],
                        .message = "transient",
                        .expect = expect,
                        .cause = BD_CAUSE_SERVER,
                        .partly = true};
        snprintf(name, sizeof(name), "transient %d at %u of %u", codes[c], at, n);
        snprintf(json, sizeof(json),
                 "{\"nMatched\": %u, \"writeErrors\": [{\"index\": %u, \"code\": %d, "
                 "\"errmsg\": \"transient %d\"}]}",
                 n - 1, at, codes[c], codes[c]);
        memset(expect, 'A', n);
        expect[n] = '\0';
        expect[at] = 'R';
        r.codes[at] = codes[c];
        check_row(&r);
    }
}

/* Rule 3: a writeConcernErrors entry: applied on the primary but not confirmed. */
Test(outcome, write_concern_errors_are_ambiguous) {
    static const struct row rows[] = {
        ROW("64 alone",
            "{\"nMatched\": 3, \"nModified\": 3, \"writeConcernErrors\": [{\"code\": 64, "
            "\"errmsg\": \"waiting for replication timed out\"}]}",
            MONGOC_ERROR_WRITE_CONCERN, 64, "waiting for replication timed out", "???",
            BD_CAUSE_SERVER, WC | PARTLY, 0),
        ROW("79 alone, nothing counted",
            "{\"writeConcernErrors\": [{\"code\": 79, \"errmsg\": \"unknown write concern\"}]}",
            MONGOC_ERROR_WRITE_CONCERN, 79, "unknown write concern", "????", BD_CAUSE_SERVER, WC,
            0),
        /* The duplicate key says the page holds the update; the write concern did not confirm
         * it, so it is not settled by this answer. */
        ROW("64 with an 11000 write error",
            "{\"nMatched\": 2, \"writeErrors\": [{\"index\": 1, \"code\": 11000, \"errmsg\": "
            "\"" DUP_MSG
            "\"}], \"writeConcernErrors\": [{\"code\": 64, \"errmsg\": \"timed out\"}]}",
            SERVER, 11000, DUP_MSG, "???", BD_CAUSE_SERVER, WC | PARTLY, 0, 11000, 0),
        ROW("79 with 121 and 17419 write errors",
            "{\"nUpserted\": 2, \"writeErrors\": [{\"index\": 0, \"code\": 121}, {\"index\": 4, "
            "\"code\": 17419}], \"writeConcernErrors\": [{\"code\": 79, \"errmsg\": \"x\"}]}",
            MONGOC_ERROR_WRITE_CONCERN, 79, "x", "P???L", BD_CAUSE_SERVER, WC | PARTLY, 121, 0, 0,
            0, 17419),
        ROW("an empty writeConcernErrors array is no write concern error",
            "{\"writeConcernErrors\": []}", SERVER, 2, "bad", "FF", BD_CAUSE_SERVER, 0, 0),
        ROW("writeConcernErrors that is not an array", "{\"writeConcernErrors\": {\"code\": 64}}",
            SERVER, 91, "shutting down", "RR", BD_CAUSE_SERVER, 0, 0),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/* Rule 3: a command-level error from the server, no update with an entry of its own. */
Test(outcome, command_level_server_errors) {
    static const struct row rows[] = {
        ROW("91, nothing executed",
            "{\"ok\": 0, \"code\": 91, \"errmsg\": \"The server is in quiesce mode\"}", SERVER, 91,
            "The server is in quiesce mode", "RRR", BD_CAUSE_SERVER, 0, 0),
        ROW("91, empty reply", "{}", SERVER, 91, "shutdown", "RRRR", BD_CAUSE_SERVER, 0, 0),
        ROW("10107, counts all zero",
            "{\"nInserted\": 0, \"nMatched\": 0, \"nModified\": 0, \"nUpserted\": 0, \"nRemoved\": "
            "0}",
            SERVER, 10107, "not primary", "RR", BD_CAUSE_SERVER, 0, 0),
        ROW("2, nothing executed", "{}", SERVER, 2, "BadValue", "FFF", BD_CAUSE_SERVER, 0, 0),
        CROW("13 in the legacy query domain", "{}", MONGOC_ERROR_QUERY, 13, "not authorized", "CC",
             BD_CAUSE_SERVER, 0, 13, 0),
        ROW("91 labelled RetryableWriteError", "{\"errorLabels\": [\"RetryableWriteError\"]}",
            SERVER, 91, "shutdown", "???", BD_CAUSE_SERVER, 0, 0),
        ROW("2 labelled RetryableWriteError among other labels",
            "{\"errorLabels\": [\"TransientTransactionError\", \"RetryableWriteError\"]}", SERVER,
            2, "x", "??", BD_CAUSE_SERVER, 0, 0),
        ROW("another label changes nothing", "{\"errorLabels\": [\"TransientTransactionError\"]}",
            SERVER, 11600, "interrupted at shutdown", "RR", BD_CAUSE_SERVER, 0, 0),
        ROW("91 after nMatched > 0", "{\"nMatched\": 2, \"nModified\": 2}", SERVER, 91, "shutdown",
            "???", BD_CAUSE_SERVER, PARTLY, 0),
        ROW("2 after nUpserted > 0", "{\"nUpserted\": 1}", SERVER, 2, "x", "???", BD_CAUSE_SERVER,
            PARTLY, 0),
        ROW("counts of other kinds (inserted, removed) count too",
            "{\"nInserted\": 1, \"nRemoved\": {\"$numberLong\": \"1\"}}", SERVER, 2, "x", "??",
            BD_CAUSE_SERVER, PARTLY, 0),
        ROW("a double count", "{\"nModified\": 1.0}", SERVER, 2, "x", "??", BD_CAUSE_SERVER, PARTLY,
            0),
        ROW("counts that are not numbers are no counts",
            "{\"nMatched\": \"2\", \"nUpserted\": true}", SERVER, 2, "x", "FF", BD_CAUSE_SERVER, 0,
            0),
        ROW("no reply document at all", NULL, SERVER, 189, "primary stepped down", "RRR",
            BD_CAUSE_SERVER, 0, 0),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/* Rule 3: the driver refused the bulk before sending it (or before sending the rest). */
Test(outcome, client_side_refusal) {
    static const char too_large[] =
        "Document 0 is too large for the cluster. Document is 16777300 bytes, max is 16777216.";
    static const struct row rows[] = {
        ROW("too large, empty reply", "{}", MONGOC_ERROR_BSON, MONGOC_ERROR_BSON_INVALID, too_large,
            "NNN", BD_CAUSE_CLIENT, 0, 0),
        ROW("too large, no reply", NULL, MONGOC_ERROR_BSON, MONGOC_ERROR_BSON_INVALID, too_large,
            "N", BD_CAUSE_CLIENT, 0, 0),
        ROW("too large after nUpserted > 0", "{\"nUpserted\": 2}", MONGOC_ERROR_BSON,
            MONGOC_ERROR_BSON_INVALID, too_large, "???", BD_CAUSE_CLIENT, PARTLY, 0),
        ROW("too large after a write error", "{\"writeErrors\": [{\"index\": 0, \"code\": 11000}]}",
            MONGOC_ERROR_BSON, MONGOC_ERROR_BSON_INVALID, too_large, "D??", BD_CAUSE_CLIENT, 0,
            11000),
        ROW("another BSON error", "{}", MONGOC_ERROR_BSON, MONGOC_ERROR_BSON_INVALID + 1, "invalid",
            "NN", BD_CAUSE_CLIENT, 0, 0),
        ROW("invalid argument", "{}", MONGOC_ERROR_COMMAND, MONGOC_ERROR_COMMAND_INVALID_ARG,
            "Invalid key 'x': update only works with $ operators", "NNNN", BD_CAUSE_CLIENT, 0, 0),
        ROW("invalid argument after nMatched > 0", "{\"nMatched\": 1}", MONGOC_ERROR_COMMAND,
            MONGOC_ERROR_COMMAND_INVALID_ARG, "x", "??", BD_CAUSE_CLIENT, PARTLY, 0),
        /* Other command-domain errors are not a refusal: the driver may have sent something. */
        ROW("another command-domain code", "{}", MONGOC_ERROR_COMMAND,
            MONGOC_ERROR_PROTOCOL_BAD_WIRE_VERSION, "x", "??", BD_CAUSE_CONNECTION, 0, 0),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/* Rule 3: nothing could be sent because no server was reachable. */
Test(outcome, unreachable_is_not_sent) {
    static const struct row rows[] = {
        ROW("server selection", "{\"errorLabels\": []}", MONGOC_ERROR_SERVER_SELECTION,
            MONGOC_ERROR_SERVER_SELECTION_FAILURE, "No suitable servers found", "NNN",
            BD_CAUSE_UNREACHABLE, 0, 0),
        ROW("server selection, no reply", NULL, MONGOC_ERROR_SERVER_SELECTION,
            MONGOC_ERROR_SERVER_SELECTION_INVALID_ID, "x", "NN", BD_CAUSE_UNREACHABLE, 0, 0),
        ROW("connect", "{}", MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_CONNECT,
            "Failed to connect to target host: localhost:27017", "NNNNN", BD_CAUSE_UNREACHABLE, 0,
            0),
        ROW("name resolution", "{}", MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_NAME_RESOLUTION,
            "Failed to resolve 'db.invalid'", "NNN", BD_CAUSE_UNREACHABLE, 0, 0),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/* Rule 3: the connection failed during the request, or an error of no known kind. */
Test(outcome, connection_failures_are_ambiguous) {
    static const struct row rows[] = {
        ROW("socket error mid-request", "{}", MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET,
            "Failed to read 4 bytes: socket error or timeout", "???", BD_CAUSE_CONNECTION, 0, 0),
        ROW("socket error, no reply", NULL, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET, "x",
            "??", BD_CAUSE_CONNECTION, 0, 0),
        ROW("socket error after a write error",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 2, \"code\": 11000}]}",
            MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET, "x", "??D", BD_CAUSE_CONNECTION,
            PARTLY, 0, 0, 11000),
        ROW("socket error with a write concern error",
            "{\"nMatched\": 2, \"writeConcernErrors\": [{\"code\": 64}]}", MONGOC_ERROR_STREAM,
            MONGOC_ERROR_STREAM_SOCKET, "x", "??", BD_CAUSE_CONNECTION, WC | PARTLY, 0),
        ROW("invalid reply", "{}", MONGOC_ERROR_PROTOCOL, MONGOC_ERROR_PROTOCOL_INVALID_REPLY,
            "Received reply with bad length", "??", BD_CAUSE_CONNECTION, 0, 0),
        ROW("client error", "{}", MONGOC_ERROR_CLIENT, MONGOC_ERROR_CLIENT_NOT_READY, "x", "?",
            BD_CAUSE_CONNECTION, 0, 0),
        ROW("failed without an error", "{}", 0, 0, "", "???", BD_CAUSE_CONNECTION, 0, 0),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/*
 * The header's rules: "any error after the server executed part of the bulk: ambiguous", and
 * not_sent means "never reached the server". A reply that counts executed updates, or that
 * carries writeErrors entries, shows the bulk reached the server, whatever error came after.
 */
Test(outcome, unreachable_after_partial_execution_is_ambiguous) {
    static const struct row rows[] = {
        ROW("server selection after nMatched > 0", "{\"nMatched\": 2, \"nModified\": 2}",
            MONGOC_ERROR_SERVER_SELECTION, MONGOC_ERROR_SERVER_SELECTION_FAILURE,
            "No suitable servers found", "???", BD_CAUSE_UNREACHABLE, PARTLY, 0),
        ROW("connect after a write error", "{\"writeErrors\": [{\"index\": 1, \"code\": 11000}]}",
            MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_CONNECT, "x", "?D?", BD_CAUSE_UNREACHABLE, 0,
            0, 11000, 0),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/*
 * updates_sent counts what reached the server: a whole bulk once it was sent, none when nothing
 * was (no server, the driver's refusal), and when the driver stopped part-way through a bulk it
 * had split into commands, the updates the server answered for (executed or refused).
 */
Test(outcome, updates_that_reached_the_server) {
    static const struct {
        const char *name;
        bool ok;
        const char *reply;
        uint32_t domain, code;
        uint32_t n, reached;
    } rows[] = {
        {"success", true, "{\"nMatched\": 3}", 0, 0, 3, 3},
        {"success without a reply", true, NULL, 0, 0, 4, 4},
        {"a server error", false, "{}", MONGOC_ERROR_SERVER, 91, 5, 5},
        {"write errors", false,
         "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 1, \"code\": 121}]}", MONGOC_ERROR_SERVER,
         121, 2, 2},
        {"a stream error mid-request", false, "{}", MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET,
         3, 3},
        {"server selection", false, "{}", MONGOC_ERROR_SERVER_SELECTION,
         MONGOC_ERROR_SERVER_SELECTION_FAILURE, 4, 0},
        {"connect, no reply", false, NULL, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_CONNECT, 2, 0},
        {"the driver's refusal", false, "{}", MONGOC_ERROR_BSON, MONGOC_ERROR_BSON_INVALID, 6, 0},
        {"refused after a first command ran", false,
         "{\"nMatched\": 2, \"nModified\": 2, "
         "\"nUpserted\": 1}",
         MONGOC_ERROR_BSON, MONGOC_ERROR_BSON_INVALID, 6, 3},
        {"unreachable after a first command ran", false,
         "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 1, \"code\": 11000}]}",
         MONGOC_ERROR_SERVER_SELECTION, MONGOC_ERROR_SERVER_SELECTION_FAILURE, 5, 2},
        {"counts past the bulk", false, "{\"nMatched\": 9}", MONGOC_ERROR_BSON,
         MONGOC_ERROR_BSON_INVALID, 4, 4},
    };
    for (size_t k = 0; k < BD_ARRAY_LEN(rows); k++) {
        struct bd_op_outcome ops[8];
        struct bd_bulk_outcome bulk;
        bson_error_t err;
        bson_t *reply = reply_of(rows[k].reply);
        error_of(&err, rows[k].domain, rows[k].code, "x");
        memset(&bulk, 0xa5, sizeof(bulk));
        bd_outcome_classify(rows[k].ok, reply, &err, rows[k].n, ops, &bulk);
        cr_expect_eq(bulk.reached, rows[k].reached, "%s: reached %u, expected %u", rows[k].name,
                     bulk.reached, rows[k].reached);
        if (reply != NULL) {
            bson_destroy(reply);
        }
    }
}

/* writeErrors entries that name no update of this bulk are not ours to judge. */
Test(outcome, write_error_indexes_outside_the_bulk_are_ignored) {
    static const struct row rows[] = {
        ROW("out of range, nothing else: the command-level rule",
            "{\"writeErrors\": [{\"index\": 3, \"code\": 11000}]}", SERVER, 11000, DUP_MSG, "FFF",
            BD_CAUSE_SERVER, 0, 0),
        ROW("out of range, transient top-level code",
            "{\"writeErrors\": [{\"index\": 3, \"code\": 121}]}", SERVER, 91, "x", "RRR",
            BD_CAUSE_SERVER, 0, 0),
        ROW("out of range after nMatched > 0",
            "{\"nMatched\": 2, \"writeErrors\": [{\"index\": 3, \"code\": 11000}]}", SERVER, 11000,
            DUP_MSG, "???", BD_CAUSE_SERVER, PARTLY, 0),
        ROW("negative", "{\"writeErrors\": [{\"index\": -1, \"code\": 11000}]}", SERVER, 2, "x",
            "FF", BD_CAUSE_SERVER, 0, 0),
        ROW("2^32 does not wrap to 0",
            "{\"writeErrors\": [{\"index\": {\"$numberLong\": \"4294967296\"}, \"code\": 11000}]}",
            SERVER, 2, "x", "FF", BD_CAUSE_SERVER, 0, 0),
        ROW("not a number", "{\"writeErrors\": [{\"index\": \"1\", \"code\": 11000}]}", SERVER, 2,
            "x", "FF", BD_CAUSE_SERVER, 0, 0),
        ROW("missing", "{\"writeErrors\": [{\"code\": 11000}]}", SERVER, 2, "x", "FF",
            BD_CAUSE_SERVER, 0, 0),
        ROW("ignored ones around a valid one",
            "{\"nMatched\": 2, \"writeErrors\": [{\"index\": 3, \"code\": 11000}, {\"index\": "
            "-2, \"code\": 11000}, {\"index\": null, \"code\": 11000}, {\"index\": 1, \"code\": "
            "121}, {\"index\": {\"$numberLong\": \"-9223372036854775808\"}, \"code\": 11000}]}",
            SERVER, 121, "x", "APA", BD_CAUSE_SERVER, PARTLY, 0, 121, 0),
        ROW("int64 and double indexes are numbers",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": {\"$numberLong\": \"2\"}, \"code\": "
            "11000}, {\"index\": 0.0, \"code\": 121}]}",
            SERVER, 121, "x", "PAD", BD_CAUSE_SERVER, PARTLY, 121, 0, 11000),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/* Entries that are not documents, fields of the wrong type: skipped, never a crash. */
Test(outcome, malformed_write_errors) {
    static const struct row rows[] = {
        ROW("entries that are not documents",
            "{\"nMatched\": 2, \"writeErrors\": [1, \"x\", [0, 11000], null, {\"index\": 0, "
            "\"code\": 11000}]}",
            SERVER, 11000, DUP_MSG, "DAA", BD_CAUSE_SERVER, PARTLY, 11000),
        ROW("only entries that are not documents", "{\"writeErrors\": [1, [0, 11000]]}", SERVER, 2,
            "x", "FF", BD_CAUSE_SERVER, 0, 0),
        ROW("writeErrors is a document",
            "{\"writeErrors\": {\"0\": {\"index\": 0, \"code\": 11000}}}", SERVER, 2, "x", "FF",
            BD_CAUSE_SERVER, 0, 0),
        ROW("writeErrors is a string", "{\"writeErrors\": \"oops\"}", SERVER, 91, "x", "RR",
            BD_CAUSE_SERVER, 0, 0),
        ROW("empty writeErrors", "{\"writeErrors\": []}", SERVER, 2, "x", "FF", BD_CAUSE_SERVER, 0,
            0),
        ROW("empty entry", "{\"writeErrors\": [{}]}", SERVER, 2, "x", "FF", BD_CAUSE_SERVER, 0, 0),
        ROW("a code that is not a number is no code",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": \"11000\"}]}", SERVER, 2,
            "x", "PA", BD_CAUSE_SERVER, PARTLY, 0),
        ROW("a double code",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 1, \"code\": 11000.0}]}", SERVER,
            11000, DUP_MSG, "AD", BD_CAUSE_SERVER, PARTLY, 0, 11000),
        ROW("codes beyond int32 are clamped",
            "{\"writeErrors\": [{\"index\": 0, \"code\": {\"$numberLong\": \"1099511627776\"}}, "
            "{\"index\": 1, \"code\": {\"$numberLong\": \"-1099511627776\"}}, {\"index\": 2, "
            "\"code\": {\"$numberLong\": \"4294978296\"}}]}",
            SERVER, 2, "x", "PPP", BD_CAUSE_SERVER, 0, INT32_MAX, INT32_MIN, INT32_MAX),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/* An errmsg that is not a string gives no message; the code still counts. */
Test(outcome, errmsg_of_the_wrong_type) {
    static const char json[] = "{\"writeErrors\": [{\"index\": 0, \"code\": 11000, \"errmsg\": 7}, "
                               "{\"index\": 1, \"errmsg\": \"text\", \"code\": 121}]}";
    bson_t *reply = reply_of(json);
    bson_error_t err;
    struct bd_op_outcome ops[2];
    struct bd_bulk_outcome bulk;
    error_of(&err, SERVER, 11000, DUP_MSG);
    bd_outcome_classify(false, reply, &err, 2, ops, &bulk);
    cr_assert_eq(ops[0].kind, BD_OUTCOME_DUPLICATE);
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[0]), "");
    cr_assert_eq(ops[1].kind, BD_OUTCOME_PERMANENT);
    cr_assert_eq(ops[1].code, 121);
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[1]), "text");
    bson_destroy(reply);
}

/* Build the reply of a bulk whose updates at[0..n_at) failed with codes[]. */
static bson_t *reply_with_errors(int64_t n_matched, const int64_t *at, const int32_t *codes,
                                 const char *const *msgs, size_t n_at) {
    bson_t *reply = bson_new();
    bson_t arr, entry;
    char key[24];
    BSON_APPEND_INT64(reply, "nMatched", n_matched);
    BSON_APPEND_ARRAY_BEGIN(reply, "writeErrors", &arr);
    for (size_t i = 0; i < n_at; i++) {
        snprintf(key, sizeof(key), "%zu", i);
        bson_append_document_begin(&arr, key, -1, &entry);
        BSON_APPEND_INT64(&entry, "index", at[i]);
        BSON_APPEND_INT32(&entry, "code", codes[i]);
        if (msgs != NULL) {
            BSON_APPEND_UTF8(&entry, "errmsg", msgs[i]);
        }
        bson_append_document_end(&arr, &entry);
    }
    bson_append_array_end(reply, &arr);
    return reply;
}

/* More than 64 updates: the marks of who has an entry of its own live on the heap. */
Test(outcome, large_bulks) {
    static const uint32_t sizes[] = {63, 64, 65, 100, 1000};
    for (size_t s = 0; s < BD_ARRAY_LEN(sizes); s++) {
        const uint32_t n = sizes[s];
        const int64_t at[] = {0, n - 1, n, n / 2, -1};
        const int32_t codes[] = {11000, 121, 11000, 17419, 11000};
        const char *msgs[] = {"first", "last", "beyond", "middle", "negative"};
        bson_t *reply = reply_with_errors(n - 2, at, codes, msgs, BD_ARRAY_LEN(at));
        bson_error_t err;
        struct bd_op_outcome *ops = calloc(n, sizeof(*ops));
        struct bd_bulk_outcome bulk;
        cr_assert_not_null(ops);
        error_of(&err, SERVER, 11000, DUP_MSG);
        bd_outcome_classify(false, reply, &err, n, ops, &bulk);
        cr_assert_eq(bulk.cause, BD_CAUSE_SERVER);
        for (uint32_t i = 0; i < n; i++) {
            enum bd_outcome want = BD_OUTCOME_APPLIED;
            const char *msg = "";
            if (i == 0) {
                want = BD_OUTCOME_DUPLICATE;
                msg = "first";
            } else if (i == n - 1) {
                want = BD_OUTCOME_PERMANENT;
                msg = "last";
            } else if (i == n / 2) {
                want = BD_OUTCOME_TOO_LARGE;
                msg = "middle";
            }
            cr_assert_eq(ops[i].kind, want, "bulk of %u: update %u is %s, expected %s", n, i,
                         bd_outcome_name(ops[i].kind), bd_outcome_name(want));
            cr_assert_str_eq(bd_outcome_message(&bulk, &ops[i]), msg, "bulk of %u: update %u", n,
                             i);
            if (want == BD_OUTCOME_APPLIED) {
                cr_assert_eq(ops[i].msg_off, UINT32_MAX, "bulk of %u: update %u", n, i);
                cr_assert_eq(ops[i].code, 0, "bulk of %u: update %u", n, i);
            }
        }
        free(ops);
        bson_destroy(reply);
    }
}

/* The same bulk of 100 updates when only the connection failed: none was settled. */
Test(outcome, large_bulk_without_own_errors) {
    enum { N = 100 };
    static struct bd_op_outcome ops[N];
    struct bd_bulk_outcome bulk;
    bson_error_t err;
    const int64_t at[] = {0, 99};
    const int32_t codes[] = {11000, 121};
    bson_t *reply = reply_with_errors(0, at, codes, NULL, 2);
    error_of(&err, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET, "socket error");
    bd_outcome_classify(false, reply, &err, N, ops, &bulk);
    cr_assert_eq(bulk.cause, BD_CAUSE_CONNECTION);
    cr_assert_eq(ops[0].kind, BD_OUTCOME_DUPLICATE);
    cr_assert_eq(ops[99].kind, BD_OUTCOME_PERMANENT);
    for (uint32_t i = 1; i < 99; i++) {
        cr_assert_eq(ops[i].kind, BD_OUTCOME_AMBIGUOUS, "update %u", i);
    }
    bson_destroy(reply);
}

/* The same for a large bulk (the marks of who has an entry live on the heap): a first command
 * of 1,000 with two refusals, the second of 1,000 never answered. */
Test(outcome, large_split_bulk_with_an_unanswered_command) {
    enum { N = 2000, FIRST = 1000 };
    static struct bd_op_outcome ops[N];
    struct bd_bulk_outcome bulk;
    bson_error_t err;
    const int64_t at[] = {3, 999};
    const int32_t codes[] = {11000, 121};
    bson_t *reply = reply_with_errors(FIRST - 2, at, codes, NULL, 2);
    error_of(&err, SERVER, 11000, DUP_MSG);
    bd_outcome_classify(false, reply, &err, N, ops, &bulk);
    cr_assert_eq(bulk.cause, BD_CAUSE_SERVER);
    cr_assert_eq(ops[3].kind, BD_OUTCOME_DUPLICATE);
    cr_assert_eq(ops[999].kind, BD_OUTCOME_PERMANENT);
    for (uint32_t i = 0; i < N; i++) {
        if (i != 3 && i != 999) {
            cr_assert_eq(ops[i].kind, BD_OUTCOME_AMBIGUOUS, "update %u is %s", i,
                         bd_outcome_name(ops[i].kind));
        }
    }
    cr_assert_eq(bulk.reached, N, "the failure that stopped the bulk is unknown: all sent");
    bson_destroy(reply);

    /* The same first command, and a second that was answered in full: nothing unanswered. */
    reply = reply_with_errors(N - 2, at, codes, NULL, 2);
    bd_outcome_classify(false, reply, &err, N, ops, &bulk);
    for (uint32_t i = 0; i < N; i++) {
        if (i != 3 && i != 999) {
            cr_assert_eq(ops[i].kind, BD_OUTCOME_APPLIED, "update %u is %s", i,
                         bd_outcome_name(ops[i].kind));
        }
    }
    bson_destroy(reply);
}

/* The note of a bulk that stopped short is cut to fit after a message as long as they come. */
Test(outcome, unanswered_note_after_a_long_message) {
    struct bd_op_outcome ops[3];
    struct bd_bulk_outcome bulk;
    bson_error_t err;
    bson_t *reply = reply_of("{\"nMatched\": 0, \"writeErrors\": [{\"index\": 0, \"code\": 121}]}");
    memset(&err, 0, sizeof(err));
    err.domain = SERVER;
    err.code = 121;
    memset(err.message, 'm', sizeof(err.message) - 1);
    memset(&bulk, 0xa5, sizeof(bulk));
    bd_outcome_classify(false, reply, &err, 3, ops, &bulk);
    cr_assert_eq(ops[0].kind, BD_OUTCOME_PERMANENT);
    cr_assert_eq(ops[1].kind, BD_OUTCOME_AMBIGUOUS);
    cr_assert_eq(ops[2].kind, BD_OUTCOME_AMBIGUOUS);
    cr_assert_eq(strlen(bulk.message), sizeof(bulk.message) - 1);
    cr_assert_eq(memcmp(bulk.message, err.message, sizeof(err.message) - 1), 0);
    cr_assert_eq(strncmp(bulk.message + sizeof(err.message) - 1, UNANSWERED(2, 3),
                         sizeof(bulk.message) - sizeof(err.message)),
                 0);
    bson_destroy(reply);
}

Test(outcome, per_update_messages) {
    const int64_t at[] = {2, 0};
    const int32_t codes[] = {121, 11000};
    const char *msgs[] = {"Document failed validation", DUP_MSG};
    bson_t *reply = reply_with_errors(1, at, codes, msgs, 2);
    bson_error_t err;
    struct bd_op_outcome ops[3];
    struct bd_bulk_outcome bulk;
    error_of(&err, SERVER, 121, "top-level message");
    bd_outcome_classify(false, reply, &err, 3, ops, &bulk);
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[0]), DUP_MSG);
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[1]), "");
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[2]), "Document failed validation");
    cr_assert_str_eq(bulk.message, "top-level message");
    cr_assert_eq(bulk.code, 121);
    /* Messages are kept NUL-separated in the order of the entries. */
    cr_assert_eq(ops[2].msg_off, 0);
    cr_assert_eq(ops[0].msg_off, sizeof("Document failed validation"));
    cr_assert_eq(bulk.text_len, sizeof("Document failed validation") + sizeof(DUP_MSG));
    bson_destroy(reply);
}

/* A full text buffer drops whole messages (never a cut one) and still classifies. */
Test(outcome, messages_truncated_when_the_text_is_full) {
    enum { N = 20, LEN = 300 };
    struct bd_bulk_outcome bulk;
    static char msgs_text[N][LEN + 1];
    const char *msgs[N];
    int64_t at[N];
    int32_t codes[N];
    for (int i = 0; i < N; i++) {
        memset(msgs_text[i], 'a' + i, LEN);
        msgs_text[i][LEN] = '\0';
        msgs[i] = msgs_text[i];
        at[i] = i;
        codes[i] = 121;
    }
    bson_t *reply = reply_with_errors(0, at, codes, msgs, N);
    bson_error_t err;
    struct bd_op_outcome ops[N];
    error_of(&err, SERVER, 121, "x");
    bd_outcome_classify(false, reply, &err, N, ops, &bulk);
    const uint32_t fit = (uint32_t)(sizeof(bulk.text) / (LEN + 1));
    for (uint32_t i = 0; i < N; i++) {
        cr_assert_eq(ops[i].kind, BD_OUTCOME_PERMANENT, "update %u", i);
        cr_assert_eq(ops[i].code, 121, "update %u", i);
        const char *m = bd_outcome_message(&bulk, &ops[i]);
        if (i < fit) {
            cr_assert_str_eq(m, msgs[i], "update %u keeps its message", i);
        } else {
            cr_assert_eq(ops[i].msg_off, UINT32_MAX, "update %u", i);
            cr_assert_str_eq(m, "", "update %u: no room left", i);
        }
    }
    cr_assert_eq(bulk.text_len, fit * (LEN + 1));
    bson_destroy(reply);
}

/* The text buffer's edge: a message filling it exactly fits, one byte more does not. */
Test(outcome, message_filling_the_whole_text) {
    struct bd_bulk_outcome bulk;
    static char exact[sizeof(bulk.text)], over[sizeof(bulk.text) + 1];
    memset(exact, 'e', sizeof(exact) - 1);
    memset(over, 'o', sizeof(over) - 1);
    const int64_t at[] = {0, 1};
    const int32_t codes[] = {121, 121};
    const char *msgs[][2] = {{exact, "next"}, {over, "next"}};
    bson_error_t err;
    struct bd_op_outcome ops[2];
    error_of(&err, SERVER, 121, "x");

    bson_t *reply = reply_with_errors(0, at, codes, msgs[0], 2);
    bd_outcome_classify(false, reply, &err, 2, ops, &bulk);
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[0]), exact);
    cr_assert_eq(bulk.text_len, sizeof(bulk.text));
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[1]), "", "the text is full");
    bson_destroy(reply);

    reply = reply_with_errors(0, at, codes, msgs[1], 2);
    bd_outcome_classify(false, reply, &err, 2, ops, &bulk);
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[0]), "", "one byte too long");
    cr_assert_eq(ops[0].code, 121);
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[1]), "next");
    bson_destroy(reply);
}

/* The top-level message is copied whole: bson_error_t's message always fits. */
Test(outcome, top_level_message) {
    bson_error_t err;
    struct bd_op_outcome op;
    struct bd_bulk_outcome bulk;
    memset(&err, 0, sizeof(err));
    err.domain = MONGOC_ERROR_STREAM;
    err.code = MONGOC_ERROR_STREAM_SOCKET;
    memset(err.message, 'm', sizeof(err.message) - 1);
    bd_outcome_classify(false, NULL, &err, 1, &op, &bulk);
    cr_assert_eq(strlen(bulk.message), sizeof(err.message) - 1);
    cr_assert_eq(memcmp(bulk.message, err.message, sizeof(err.message)), 0);
    cr_assert_eq(op.kind, BD_OUTCOME_AMBIGUOUS);
}

Test(outcome, no_updates) {
    bson_t *reply = reply_of("{\"writeErrors\": [{\"index\": 0, \"code\": 11000}]}");
    bson_error_t err;
    struct bd_op_outcome op = {.kind = 0xff};
    struct bd_bulk_outcome bulk;
    error_of(&err, SERVER, 91, "x");
    bd_outcome_classify(false, reply, &err, 0, &op, &bulk);
    cr_assert_eq(bulk.cause, BD_CAUSE_SERVER);
    cr_assert_eq(op.kind, 0xff, "no update to write to");
    cr_assert_eq(bulk.text_len, 0);
    bson_destroy(reply);
}

Test(outcome, transient_codes) {
    static const int64_t yes[] = {6,   7,   50,   64,    89,    91,    112,   189,
                                  262, 365, 9001, 10107, 11600, 11602, 13435, 13436};
    static const int64_t no[] = {0,         1,        2,     11,   13,
                                 18,        61,       121,   8000, 10334,
                                 11000,     17419,    17420, -91,  91 + (INT64_C(1) << 32),
                                 INT64_MIN, INT64_MAX};
    for (size_t i = 0; i < BD_ARRAY_LEN(yes); i++) {
        cr_assert(bd_outcome_transient_code(yes[i]), "%" PRId64 " is transient", yes[i]);
    }
    for (size_t i = 0; i < BD_ARRAY_LEN(no); i++) {
        cr_assert(!bd_outcome_transient_code(no[i]), "%" PRId64 " is not transient", no[i]);
    }
}

Test(outcome, names) {
    cr_assert_str_eq(bd_outcome_name(BD_OUTCOME_APPLIED), "applied");
    cr_assert_str_eq(bd_outcome_name(BD_OUTCOME_NOT_SENT), "not_sent");
    cr_assert_str_eq(bd_outcome_name(BD_OUTCOME_AMBIGUOUS), "ambiguous");
    cr_assert_str_eq(bd_outcome_name(BD_OUTCOME_RETRY), "retry");
    cr_assert_str_eq(bd_outcome_name(BD_OUTCOME_DUPLICATE), "duplicate");
    cr_assert_str_eq(bd_outcome_name(BD_OUTCOME_TOO_LARGE), "too_large");
    cr_assert_str_eq(bd_outcome_name(BD_OUTCOME_REFUSED), "refused");
    cr_assert_str_eq(bd_outcome_name(BD_OUTCOME_PERMANENT), "permanent");
    cr_assert_str_eq(bd_outcome_name(BD_OUTCOME_CONFIG), "config");
    cr_assert_str_eq(bd_outcome_name((enum bd_outcome)(BD_OUTCOME_CONFIG + 1)), "?");
    cr_assert_str_eq(bd_outcome_name((enum bd_outcome) - 1), "?");
    cr_assert_str_eq(bd_outcome_name((enum bd_outcome)255), "?");
}

/*
 * Out of memory for the marks of a bulk of more than 64 updates: nothing can be judged, so
 * every update is ambiguous. The marks come from bd_calloc, whose failure switch reaches them.
 */
Test(outcome, out_of_memory_for_a_large_bulk) {
    enum { N = 1001 };
    static struct bd_op_outcome ops[N];
    struct bd_bulk_outcome bulk;
    bson_error_t err;
    const int64_t at[] = {0};
    const int32_t codes[] = {121};
    bson_t *reply = reply_with_errors(0, at, codes, NULL, 1);
    error_of(&err, SERVER, 121, "x");
    bd_alloc_fail_after(0, 0);
    bd_outcome_classify(false, reply, &err, N, ops, &bulk);
    cr_assert_eq(bd_alloc_fail_after(-1, 0), 1, "one allocation, the marks");
    cr_assert_eq(bulk.cause, BD_CAUSE_CONNECTION);
    for (uint32_t i = 0; i < N; i++) {
        cr_assert_eq(ops[i].kind, BD_OUTCOME_AMBIGUOUS, "update %u", i);
        cr_assert_eq(ops[i].msg_off, UINT32_MAX, "update %u", i);
    }
    bson_destroy(reply);
}

/*
 * Deployment errors: not applied, nothing wrong with the update; "config", sent again until the
 * operator fixes the deployment, never quarantined. Every code of the class, as an update's own
 * entry and as a command-level error.
 */
Test(outcome, deployment_codes_are_config) {
    static const int32_t codes[] = {13, 18, 61, 100, 168, 224, 371};
    for (size_t c = 0; c < BD_ARRAY_LEN(codes); c++) {
        const uint32_t n = 2 + (uint32_t)(c % 3), at = (uint32_t)(c % n);
        char json[256], expect[8], all[8], name[64];
        struct row r = {.name = name,
                        .reply = json,
                        .domain = SERVER,
                        .code = (uint32_t)codes[c],
                        .message = "refused",
                        .expect = expect,
                        .cause = BD_CAUSE_SERVER,
                        .partly = true,
                        .config = codes[c]};
        snprintf(name, sizeof(name), "own %d at %u of %u", codes[c], at, n);
        snprintf(json, sizeof(json),
                 "{\"nMatched\": %u, \"writeErrors\": [{\"index\": %u, \"code\": %d, "
                 "\"errmsg\": \"refused\"}]}",
                 n - 1, at, codes[c]);
        memset(expect, 'A', n);
        expect[n] = '\0';
        expect[at] = 'C';
        r.codes[at] = codes[c];
        check_row(&r);

        struct row cmd = {.name = name,
                          .reply = "{\"ok\": 0}",
                          .domain = SERVER,
                          .code = (uint32_t)codes[c],
                          .message = "refused",
                          .expect = all,
                          .cause = BD_CAUSE_SERVER,
                          .config = codes[c]};
        snprintf(name, sizeof(name), "command-level %d, %u updates", codes[c], n);
        memset(all, 'C', n);
        all[n] = '\0';
        check_row(&cmd);
    }
}

Test(outcome, deployment_errors_in_other_places) {
    static const struct row rows[] = {
        /* The server applied the write, then found the write concern unsatisfiable: maybe
         * applied, and the message says what to fix. */
        CROW("100 as a write concern error",
             "{\"nMatched\": 2, \"nModified\": 2, \"writeConcernErrors\": [{\"code\": 100, "
             "\"codeName\": \"UnsatisfiableWriteConcern\", \"errmsg\": \"Not enough data-bearing "
             "nodes\"}]}",
             MONGOC_ERROR_WRITE_CONCERN, 100, "Not enough data-bearing nodes", "??",
             BD_CAUSE_SERVER, WC | PARTLY, 100, 0),
        /* The retry of those: duplicate keys, and the write concern still unsatisfiable. Not
         * settled: nothing confirmed the pages. */
        CROW("100 with the duplicate keys of a retry",
             "{\"writeErrors\": [{\"index\": 0, \"code\": 11000, \"errmsg\": \"" DUP_MSG "\"}, "
             "{\"index\": 1, \"code\": 11000}], \"writeConcernErrors\": [{\"code\": 100, "
             "\"errmsg\": \"Not enough data-bearing nodes\"}]}",
             SERVER, 11000, DUP_MSG, "???", BD_CAUSE_SERVER, WC, 100, 11000, 11000, 0),
        /* Another write concern error first: the deployment code still names the fix. */
        CROW("100 after 64 among the write concern errors",
             "{\"nMatched\": 1, \"writeConcernErrors\": [{\"code\": 64}, {\"code\": 100, "
             "\"errmsg\": \"x\"}]}",
             MONGOC_ERROR_WRITE_CONCERN, 64, "timed out", "?", BD_CAUSE_SERVER, WC | PARTLY, 100,
             0),
        CROW("61 after part of the bulk ran: ambiguous, named", "{\"nUpserted\": 1}", SERVER, 61,
             "could not extract exact shard key", "??", BD_CAUSE_SERVER, PARTLY, 61, 0),
        CROW("61 labelled RetryableWriteError: ambiguous, named",
             "{\"errorLabels\": [\"RetryableWriteError\"]}", SERVER, 61, "x", "??", BD_CAUSE_SERVER,
             0, 61, 0),
        /* Own refusals of several classes: the first deployment code is named. */
        CROW("61 and 13 among other refusals",
             "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 121}, {\"index\": 1, "
             "\"code\": 61}, {\"index\": 2, \"code\": 13}]}",
             SERVER, 121, "Document failed validation", "PCCA", BD_CAUSE_SERVER, PARTLY, 61, 121,
             61, 13, 0),
        /* Not of the class. */
        ROW("79 as a write concern error is no deployment code",
            "{\"writeConcernErrors\": [{\"code\": 79}]}", MONGOC_ERROR_WRITE_CONCERN, 79, "x", "??",
            BD_CAUSE_SERVER, WC, 0),
        ROW("8000 command-level is refused", "{}", SERVER, 8000, "AtlasError", "FF",
            BD_CAUSE_SERVER, 0, 0),
        ROW("2 command-level is refused", "{}", SERVER, 2, "cannot use 'w' > 1", "F",
            BD_CAUSE_SERVER, 0, 0),
        /* Driver-side codes that share a number with a server code are not server codes. */
        ROW("server selection with a driver code of 13", "{}", MONGOC_ERROR_SERVER_SELECTION, 13,
            "No suitable servers found", "NN", BD_CAUSE_UNREACHABLE, 0, 0),
        ROW("a client error with a driver code of 18", "{}", MONGOC_ERROR_CLIENT, 18, "x", "?",
            BD_CAUSE_CONNECTION, 0, 0),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/* The message names the fix, then what MongoDB said with that very code. */
Test(outcome, deployment_error_messages) {
    struct bd_op_outcome ops[3];
    struct bd_bulk_outcome bulk;
    bson_error_t err;
    char want[sizeof(bulk.message)];

    /* From an update's own entry, not from the bulk's message. */
    bson_t *reply = reply_of("{\"writeErrors\": [{\"index\": 0, \"code\": 121, \"errmsg\": "
                             "\"Document failed validation\"}, {\"index\": 2, \"code\": 61, "
                             "\"errmsg\": \"Failed to target upsert by query :: could not "
                             "extract exact shard key\"}]}");
    error_of(&err, SERVER, 121, "Multiple write errors");
    bd_outcome_classify(false, reply, &err, 3, ops, &bulk);
    snprintf(want, sizeof(want),
             "the collection is sharded on a key bucketd's upserts cannot target (their "
             "filters hold equalities on _id, sensor_id and bucket_start only): shard it on "
             "{sensor_id: \"hashed\"} or {sensor_id: 1, bucket_start: 1}; MongoDB answered "
             "code 61: Failed to target upsert by query :: could not extract exact shard key");
    cr_assert_str_eq(bulk.message, want);
    cr_assert_eq(bulk.code, 121, "the top-level code stays the driver's");
    cr_assert_str_eq(bd_outcome_message(&bulk, &ops[2]),
                     "Failed to target upsert by query :: could not extract exact shard key");
    bson_destroy(reply);

    /* From the write concern error. */
    reply = reply_of("{\"nMatched\": 1, \"writeConcernErrors\": [{\"code\": 100, \"errmsg\": "
                     "\"Not enough data-bearing nodes\"}]}");
    error_of(&err, MONGOC_ERROR_WRITE_CONCERN, 100, "Not enough data-bearing nodes");
    bd_outcome_classify(false, reply, &err, 1, ops, &bulk);
    cr_assert_not_null(strstr(bulk.message, "write_concern cannot be satisfied by this "
                                            "deployment"));
    cr_assert_not_null(strstr(bulk.message, "; MongoDB answered code 100: Not enough "
                                            "data-bearing nodes"));
    bson_destroy(reply);

    /* From the command's error; a message as long as bson_error_t allows is cut, not overrun. */
    memset(&err, 0, sizeof(err));
    err.domain = SERVER;
    err.code = 13;
    memset(err.message, 'm', sizeof(err.message) - 1);
    bd_outcome_classify(false, NULL, &err, 2, ops, &bulk);
    cr_assert_eq(ops[0].kind, BD_OUTCOME_CONFIG);
    cr_assert_eq(strlen(bulk.message), sizeof(bulk.message) - 1);
    cr_assert_eq(
        strncmp(bulk.message, bd_outcome_config_advice(13), strlen(bd_outcome_config_advice(13))),
        0);
}

Test(outcome, deployment_codes) {
    static const int64_t yes[] = {13, 18, 61, 100, 168, 224, 371};
    static const int64_t no[] = {0,   2,   11,   64,    79,    91,    121,
                                 365, -61, 8000, 11000, 17419, 10107, 61 + (INT64_C(1) << 32)};
    for (size_t i = 0; i < BD_ARRAY_LEN(yes); i++) {
        const char *a = bd_outcome_config_advice(yes[i]);
        cr_assert_not_null(a, "%" PRId64 " is a deployment code", yes[i]);
        cr_assert_gt(strlen(a), 20);
        cr_assert(!bd_outcome_transient_code(yes[i]), "%" PRId64 " is not transient", yes[i]);
    }
    for (size_t i = 0; i < BD_ARRAY_LEN(no); i++) {
        cr_assert_null(bd_outcome_config_advice(no[i]), "%" PRId64 " is no deployment code", no[i]);
    }
    cr_assert_not_null(strstr(bd_outcome_config_advice(61), "{sensor_id: \"hashed\"}"));
    cr_assert_not_null(strstr(bd_outcome_config_advice(61), "{sensor_id: 1, bucket_start: 1}"));
    cr_assert_not_null(strstr(bd_outcome_config_advice(100), "write_concern"));
}

/*
 * RetryableWriteError: whatever it labels may have been applied, so the updates without an
 * entry of their own are ambiguous (sent again, never refused), wherever the label is.
 */
Test(outcome, retryable_write_error_labels) {
    static const struct row rows[] = {
        /* A bulk the driver split: one command answered writeErrors, another failed with a
         * labelled error. The updates without an entry are not known to be applied. */
        ROW("label beside an 11000 write error",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 11000}], "
            "\"errorLabels\": [\"RetryableWriteError\"]}",
            SERVER, 11000, DUP_MSG, "D??", BD_CAUSE_SERVER, PARTLY, 11000),
        ROW("label beside a 121 write error",
            "{\"writeErrors\": [{\"index\": 1, \"code\": 121}], \"errorLabels\": "
            "[\"RetryableWriteError\"]}",
            SERVER, 121, "x", "?P", BD_CAUSE_SERVER, 0, 0, 121),
        ROW("label in an entry of writeConcernErrors",
            "{\"writeConcernErrors\": [{\"code\": 91, \"errmsg\": \"x\", \"errorLabels\": "
            "[\"RetryableWriteError\"]}]}",
            MONGOC_ERROR_WRITE_CONCERN, 91, "x", "??", BD_CAUSE_SERVER, WC, 0),
        ROW("label in a server's writeConcernError beside a write error",
            "{\"writeErrors\": [{\"index\": 0, \"code\": 121}], \"writeConcernError\": {\"code\": "
            "91, \"errorLabels\": [\"RetryableWriteError\"]}}",
            SERVER, 121, "x", "P?", BD_CAUSE_SERVER, 0, 121),
        ROW("label on a code of no known class", "{\"errorLabels\": [\"RetryableWriteError\"]}",
            SERVER, 8000, "x", "??", BD_CAUSE_SERVER, 0, 0),
        /* Labels that are not the label, or not strings, change nothing. */
        ROW("other labels beside a write error",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 121}], \"errorLabels\": "
            "[\"TransientTransactionError\", 7, null]}",
            SERVER, 121, "x", "PA", BD_CAUSE_SERVER, PARTLY, 121),
        ROW("errorLabels that is not an array",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 121}], \"errorLabels\": "
            "\"RetryableWriteError\"}",
            SERVER, 121, "x", "PA", BD_CAUSE_SERVER, PARTLY, 121),
        ROW("a writeConcernError that is not a document",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 0, \"code\": 121}], "
            "\"writeConcernError\": 1}",
            SERVER, 121, "x", "PA", BD_CAUSE_SERVER, PARTLY, 121),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}

/* 365 TemporarilyUnavailable, command-level or an update's own: retried, never refused. */
Test(outcome, temporarily_unavailable_is_retried) {
    static const struct row rows[] = {
        ROW("365 command-level", "{\"ok\": 0, \"code\": 365}", SERVER, 365,
            "TemporarilyUnavailable", "RRR", BD_CAUSE_SERVER, 0, 0),
        ROW("365 at 1 of 2",
            "{\"nMatched\": 1, \"writeErrors\": [{\"index\": 1, \"code\": 365, \"errmsg\": "
            "\"TemporarilyUnavailable\"}]}",
            SERVER, 365, "TemporarilyUnavailable", "AR", BD_CAUSE_SERVER, PARTLY, 0, 365),
    };
    check_rows(rows, BD_ARRAY_LEN(rows));
}
