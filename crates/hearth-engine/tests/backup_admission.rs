//! Where a VirtualMachineBackup (or a schedule's `backup`) may write,
//! checked at apply through the engine and its real store: never into
//! hearthd's state directory (nor a directory holding it), also not through
//! a symbolic link that leads there, and only under a parent that exists.
//! No VM boots.

mod common;

use common::engine_config;
use hearth_api::parse_documents;
use hearth_engine::{Engine, RequestError};

fn backup(name: &str, to: &std::path::Path) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachineBackup\nmetadata:\n  name: {name}\nspec:\n  virtualMachineName: vm\n  to: {}\n",
        to.display()
    )
}

/// A schedule's runs are backups the schedule makes itself, past the
/// apply: its `backup.to` is checked when it is applied.
fn schedule(name: &str, to: &std::path::Path) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachineSnapshotSchedule\nmetadata:\n  name: {name}\nspec:\n  schedule: \"@daily\"\n  virtualMachineNames: [vm]\n  backup:\n    to: {}\n",
        to.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_target_in_the_state_directory_is_refused_even_through_a_link() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = Engine::start(engine_config(dir.path(), vec![]))
        .await
        .expect("engine");
    let state = dir.path().join("state");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    // A link outside the state directory that leads into it.
    std::os::unix::fs::symlink(&state, outside.join("into-state")).unwrap();
    let apply = |yaml: String| {
        let objects = parse_documents(&yaml, "t.yaml").expect("objects");
        engine.apply(objects, "api").map(|_| ())
    };
    for (name, to, says) in [
        ("in", state.join("b"), "state directory"),
        ("holds", dir.path().to_path_buf(), "state directory"),
        ("link", outside.join("into-state/b"), "state directory"),
        ("link-itself", outside.join("into-state"), "state directory"),
        ("no-parent", outside.join("typo/b"), "does not exist"),
    ] {
        for (yaml, field) in [
            (backup(name, &to), "spec.to"),
            (schedule(name, &to), "spec.backup.to"),
        ] {
            match apply(yaml) {
                Err(RequestError::Invalid(e)) => {
                    assert_eq!(e.field, field, "{name}: {e:?}");
                    assert!(e.message.contains(says), "{name}: {}", e.message);
                }
                other => panic!("{name} ({}), {field}: not refused: {other:?}", to.display()),
            }
        }
    }
    apply(backup("fine", &outside.join("b"))).expect("a target outside the state directory");
    apply(schedule("fine", &outside.join("b"))).expect("a schedule's target outside it");
}
