-- The id or string the engine said ended the completion (a model's second end token, a stop string): its parse
-- drops it, as the answer's did.
ALTER TABLE turns ADD COLUMN stop_reason BLOB;
