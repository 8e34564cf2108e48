-- The enabled triggers of a relation on the search_path, by name (the schema check: the queue
-- controls table's triggers of room grants; a trigger disabled with ALTER TABLE … DISABLE
-- TRIGGER is left out).
--
-- Parameters: $1 the relation's quoted name.
SELECT t.tgname::text AS name
FROM pg_trigger AS t
WHERE t.tgrelid = to_regclass($1) AND NOT t.tgisinternal AND t.tgenabled <> 'D'
