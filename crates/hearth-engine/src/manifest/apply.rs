//! The engine calls of a source of manifests (the directory, a git
//! repository): the core's commands carried out with the source's owner
//! strings, and its problems told as events and a `ManifestValid`
//! condition on the object.

use std::path::Path;
use std::sync::Arc;

use chrono::Utc;
use hearth_api::{Condition, ConditionStatus, EventType, Kind, set_condition};
use serde_json::Value;

use super::core::{Command, Decl, Key, Outcome, Problem, Stored};
use super::owner::SourceOwner;
use crate::engine::{Engine, RequestError};

/// The condition an object from a source carries once its file had a
/// problem: False while it has one, True once resolved.
pub const CONDITION: &str = "ManifestValid";

/// Carries out a source's commands.
pub struct Applier {
    pub engine: Arc<Engine>,
    pub owner: SourceOwner,
}

impl Applier {
    pub fn execute(&self, command: &Command) -> Outcome {
        match command {
            Command::Apply { file, decls } => {
                let owner = self.owner.owner_string(file);
                let objects = decls.iter().map(|d| d.object.clone()).collect();
                match self.engine.apply(objects, &owner) {
                    Ok(outcomes) => {
                        for o in outcomes {
                            tracing::info!(kind = o.kind.as_str(), name = o.name, action = ?o.action, owner = %self.owner.owner_string(file), "applied from a source");
                            if o.action != crate::engine::ApplyAction::Unchanged {
                                self.warn_not_honoured(file, decls, o.kind, &o.name);
                            }
                        }
                        Outcome::Done
                    }
                    Err(e) => {
                        tracing::warn!(file = %file.display(), error = %e, "manifest refused");
                        Outcome::Refused(e.to_string())
                    }
                }
            }
            Command::Delete { key, file } => {
                match self
                    .engine
                    .delete(key.0, &key.1, &self.owner.owner_string(file))
                {
                    Ok(()) => {
                        tracing::info!(kind = key.0.as_str(), name = key.1, owner = %self.owner.owner_string(file), "manifest file gone: deleting");
                        Outcome::Done
                    }
                    Err(RequestError::NotFound { .. }) => Outcome::NotFound,
                    Err(e) => Outcome::Refused(e.to_string()),
                }
            }
            Command::Report { key, problem } => {
                self.report(key, problem.as_ref());
                Outcome::Done
            }
        }
    }

    /// A field of another tool's manifest that hearth does not honour
    /// (docs/ignite.md) is a warning event each time the object is written.
    fn warn_not_honoured(&self, file: &Path, decls: &[Decl], kind: Kind, name: &str) {
        let Some(d) = decls
            .iter()
            .find(|d| d.object.kind() == kind && d.object.name() == name)
        else {
            return;
        };
        for (field, message) in hearth_api::ignite::warnings_of(&d.object.metadata().annotations) {
            self.engine.ctx().event(
                kind,
                name,
                EventType::Warning,
                "FieldNotHonoured",
                &format!("{}: {field}: {message}", file.display()),
            );
        }
    }

    fn report(&self, key: &Key, problem: Option<&Problem>) {
        let (kind, name) = (key.0, key.1.as_str());
        match problem {
            Some(p) => {
                tracing::warn!(
                    kind = kind.as_str(),
                    name,
                    reason = p.reason(),
                    "{}",
                    p.message()
                );
                self.engine
                    .ctx()
                    .event(kind, name, EventType::Warning, p.reason(), &p.message());
                set_manifest_condition(
                    &self.engine,
                    key,
                    ConditionStatus::False,
                    p.reason(),
                    &p.message(),
                );
            }
            None => {
                let message = "the manifest problem is resolved: the object follows its file again";
                self.engine
                    .ctx()
                    .event(kind, name, EventType::Normal, "ManifestValid", message);
                set_manifest_condition(
                    &self.engine,
                    key,
                    ConditionStatus::True,
                    "ManifestValid",
                    message,
                );
            }
        }
    }
}

/// Every object the store holds with an owner of `owner`'s source.
pub fn owned_objects(engine: &Engine, owner: &SourceOwner) -> Vec<Stored> {
    let mut out = Vec::new();
    for kind in Kind::ALL {
        let Ok(objects) = engine.list(kind) else {
            continue;
        };
        for s in objects {
            if s.deleting {
                continue;
            }
            if let Some(file) = s
                .object
                .metadata()
                .managed_by
                .as_deref()
                .and_then(|m| owner.file_of(m))
            {
                out.push(Stored {
                    owner: file,
                    object: s.object,
                });
            }
        }
    }
    out
}

/// Sets the `ManifestValid` condition. Typed for the kinds whose status the
/// engine writes typed (so a first status write keeps it); other kinds get it
/// only once they have a status.
fn set_manifest_condition(
    engine: &Engine,
    key: &Key,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    let now = Utc::now();
    let set = |c: &mut Vec<Condition>| set_condition(c, CONDITION, status, reason, message, now);
    let (kind, name) = (key.0, key.1.as_str());
    if kind == Kind::VirtualMachine {
        engine.ctx().set_vm_status(name, |s| set(&mut s.conditions));
    } else if kind == Kind::VirtualDisk {
        engine
            .ctx()
            .set_disk_status(name, |s| set(&mut s.conditions));
    } else {
        let r = engine
            .ctx()
            .store
            .update_status::<Value, _>(kind, name, |v| {
                if let Value::Object(map) = v {
                    let mut conditions: Vec<Condition> = map
                        .get("conditions")
                        .and_then(|c| serde_json::from_value(c.clone()).ok())
                        .unwrap_or_default();
                    set(&mut conditions);
                    if let Ok(c) = serde_json::to_value(conditions) {
                        map.insert("conditions".into(), c);
                    }
                }
            });
        if let Err(e) = r {
            tracing::warn!(kind = kind.as_str(), name, error = %e, "cannot write status");
        }
    }
}
