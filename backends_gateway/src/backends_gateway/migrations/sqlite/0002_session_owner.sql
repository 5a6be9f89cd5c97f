-- The name of the harness key a session belongs to (NULL on a gateway without keys).
ALTER TABLE sessions ADD COLUMN owner TEXT;
CREATE INDEX sessions_by_owner ON sessions (owner, created);
