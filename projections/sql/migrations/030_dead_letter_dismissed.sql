-- 030: an operator's DeadLetterDismissed (on the dead-letter topic) closes a dead letter that has
-- nothing to replay or fail (an undecodable record): the row stays, marked dismissed, and is no
-- longer pending (issue 44 item 6: such a dead letter's alert could never clear).

ALTER TABLE dead_letters
    ADD COLUMN dismissed_at   timestamptz,
    ADD COLUMN dismissed_by   text,
    ADD COLUMN dismiss_reason text;

COMMENT ON COLUMN dead_letters.dismissed_at IS 'Broker time (UTC) of the operator''s DeadLetterDismissed; NULL while not dismissed';
COMMENT ON COLUMN dead_letters.dismissed_by IS 'Operator who dismissed it';
COMMENT ON COLUMN dead_letters.dismiss_reason IS 'The operator''s reason for the dismissal';
