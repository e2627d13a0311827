//! The `events` table: what happened to each object, bounded per object.

use chrono::{DateTime, Utc};
use hearth_api::{Event, EventType, Kind};
use rusqlite::{Connection, params};

use super::changes::{self, CURRENT_LIFE, event_from_row};
use super::{Store, StoreError};

/// Events kept per object; older ones are dropped.
pub(super) const EVENTS_PER_OBJECT: i64 = 200;

/// Adds `events.life` to a database from before it: every event then
/// belongs to the current object of its name, as all of them were shown.
impl Store {
    pub fn record_event(
        &self,
        kind: Kind,
        name: &str,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), StoreError> {
        self.with_tx(|tx| Self::record_event_tx(tx, Utc::now(), kind, name, type_, reason, message))
    }

    /// `record_event` inside a caller's transaction, with the time the
    /// event happened (so a write that joins a later transaction keeps it).
    pub fn record_event_tx(
        tx: &rusqlite::Transaction<'_>,
        time: DateTime<Utc>,
        kind: Kind,
        name: &str,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), StoreError> {
        Self::record_tx(tx, time, kind.as_str(), name, type_, reason, message)
    }

    /// An event about a source of manifests (kind
    /// [`hearth_api::SOURCE_EVENT_KIND`]), kept and bounded as an
    /// object's are, and in the change stream.
    pub fn record_source_event(
        &self,
        source: &str,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), StoreError> {
        self.with_tx(|tx| {
            Self::record_tx(
                tx,
                Utc::now(),
                hearth_api::SOURCE_EVENT_KIND,
                source,
                type_,
                reason,
                message,
            )
        })
    }

    fn record_tx(
        tx: &rusqlite::Transaction<'_>,
        time: DateTime<Utc>,
        kind: &str,
        name: &str,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), StoreError> {
        let type_text = match type_ {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        };
        // Shown to anyone who reads events: no URL's credentials.
        let message = &*hearth_api::redact::redact_credentials(message);
        let event = Event {
            time,
            kind: kind.to_string(),
            name: name.to_string(),
            type_,
            reason: reason.to_string(),
            message: message.to_string(),
        };
        let seq = changes::log_event_tx(tx, &event)?;
        tx.execute(
            &format!(
                "INSERT INTO events (time, kind, name, type, reason, message, seq, life)
                 SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, {CURRENT_LIFE}
                 FROM (SELECT ?2 AS kind, ?3 AS name) e"
            ),
            params![
                event.time.to_rfc3339(),
                kind,
                name,
                type_text,
                reason,
                message,
                seq as i64
            ],
        )?;
        tx.execute(
            "DELETE FROM events WHERE kind = ?1 AND name = ?2 AND id <= (
                SELECT id FROM events WHERE kind = ?1 AND name = ?2 ORDER BY id DESC LIMIT 1 OFFSET ?3)",
            params![kind, name, EVENTS_PER_OBJECT],
        )?;
        Ok(())
    }

    /// Events oldest first; the newest `limit` of them. With a name, only
    /// those of the current life of each object of that name (the one that
    /// exists, or the last one to have).
    pub fn events(
        &self,
        kind: Option<Kind>,
        name: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        Self::events_tx(&self.conn(), kind, name, limit)
    }

    /// `events` on a given connection.
    pub(super) fn events_tx(
        conn: &Connection,
        kind: Option<Kind>,
        name: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        let mut stmt = conn.prepare(&format!(
            "SELECT e.time, e.kind, e.name, e.type, e.reason, e.message FROM events e
             WHERE (?1 IS NULL OR e.kind = ?1)
               AND (?2 IS NULL OR (e.name = ?2 AND e.life IS {CURRENT_LIFE}))
             ORDER BY e.id DESC LIMIT ?3"
        ))?;
        let rows = stmt.query_map(params![kind.map(|k| k.as_str()), name, limit as i64], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, String>(5)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (time, kind, name, type_, reason, message) = row?;
            out.push(event_from_row(time, kind, name, &type_, reason, message));
        }
        out.reverse();
        Ok(out)
    }
}
