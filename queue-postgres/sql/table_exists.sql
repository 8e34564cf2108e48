-- Whether a relation exists on the search_path (the schema check: the queue controls table).
--
-- Parameters: $1 the relation's quoted name.
SELECT to_regclass($1) IS NOT NULL AS present
