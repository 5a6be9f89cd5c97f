-- Where each image of a turn's prompt lies in its prompt ids, as JSON [[start, end], ...] (NULL on turns kept
-- before: their images, if any, have no known spans and are never extended).
ALTER TABLE turns ADD COLUMN image_spans BYTEA;
