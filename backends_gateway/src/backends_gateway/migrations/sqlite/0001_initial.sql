-- Sessions, their branches and their turns. IF NOT EXISTS: a store written before numbered migrations existed
-- already has these tables and is brought forward from here.
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, grp TEXT, status TEXT NOT NULL, reward REAL, reward_info BLOB,
    created REAL NOT NULL, closed REAL, counts BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_by_group ON sessions (grp, status);
CREATE INDEX IF NOT EXISTS sessions_by_close ON sessions (status, closed);
CREATE TABLE IF NOT EXISTS branches (
    session TEXT NOT NULL, branch INTEGER NOT NULL, parent_branch INTEGER, parent_turn INTEGER,
    reason TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (session, branch)
);
CREATE TABLE IF NOT EXISTS turns (
    session TEXT NOT NULL, turn INTEGER NOT NULL, branch INTEGER NOT NULL, parent INTEGER, created REAL NOT NULL,
    messages BLOB NOT NULL, tools BLOB, template_kwargs BLOB, reply BLOB NOT NULL,
    prompt_ids BLOB NOT NULL, completion_ids BLOB NOT NULL, logprobs BLOB NOT NULL, finish_reason TEXT NOT NULL,
    weight_version TEXT, weight_versions BLOB NOT NULL, message_spans BLOB NOT NULL, server TEXT,
    reused_ids INTEGER NOT NULL, routed_experts BLOB, routed_start INTEGER, request BLOB NOT NULL,
    PRIMARY KEY (session, turn)
);
