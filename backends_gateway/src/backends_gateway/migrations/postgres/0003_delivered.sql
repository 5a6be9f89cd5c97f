-- Whether the harness received the turn's answer (0: the client went away as it was written; no training sample).
ALTER TABLE turns ADD COLUMN delivered INTEGER NOT NULL DEFAULT 1;
