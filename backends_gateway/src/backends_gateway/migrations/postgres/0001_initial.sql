-- Sessions, their branches and their turns, as the SQLite store keeps them (owner included). JSON is kept as the
-- exact bytes the gateway wrote (bytea, not jsonb: read back, it hashes to the same digests), id arrays as
-- little-endian int32 bytes, logprobs as float32 bytes. Ids compare bytewise (COLLATE "C"), as in SQLite.
CREATE TABLE sessions (
    id TEXT COLLATE "C" PRIMARY KEY, grp TEXT COLLATE "C", status TEXT NOT NULL, reward DOUBLE PRECISION,
    reward_info BYTEA, created DOUBLE PRECISION NOT NULL, closed DOUBLE PRECISION, counts BYTEA NOT NULL,
    owner TEXT COLLATE "C"
);
CREATE INDEX sessions_by_group ON sessions (grp, status);
CREATE INDEX sessions_by_close ON sessions (status, closed);
CREATE INDEX sessions_by_created ON sessions (created, id);
CREATE INDEX sessions_by_owner ON sessions (owner, created);
CREATE TABLE branches (
    session TEXT COLLATE "C" NOT NULL, branch INTEGER NOT NULL, parent_branch INTEGER, parent_turn INTEGER,
    reason TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, PRIMARY KEY (session, branch)
);
CREATE TABLE turns (
    session TEXT COLLATE "C" NOT NULL, turn INTEGER NOT NULL, branch INTEGER NOT NULL, parent INTEGER,
    created DOUBLE PRECISION NOT NULL, messages BYTEA NOT NULL, tools BYTEA, template_kwargs BYTEA,
    reply BYTEA NOT NULL, prompt_ids BYTEA NOT NULL, completion_ids BYTEA NOT NULL, logprobs BYTEA NOT NULL,
    finish_reason TEXT NOT NULL, weight_version TEXT, weight_versions BYTEA NOT NULL, message_spans BYTEA NOT NULL,
    server TEXT, reused_ids INTEGER NOT NULL, routed_experts BYTEA, routed_start INTEGER, request BYTEA NOT NULL,
    PRIMARY KEY (session, turn)
);
