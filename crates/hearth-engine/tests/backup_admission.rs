//! Where a VirtualMachineBackup may write, checked at apply through the
//! engine and its real store: never into hearthd's state directory (nor a
//! directory holding it), also not through a symbolic link that leads
//! there, and only under a parent that exists. No VM boots.

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
    let apply = |name: &str, to: &std::path::Path| {
        let objects = parse_documents(&backup(name, to), "t.yaml").expect("objects");
        engine.apply(objects, "api").map(|_| ())
    };
    for (name, to, says) in [
        ("in", state.join("b"), "state directory"),
        ("holds", dir.path().to_path_buf(), "state directory"),
        ("link", outside.join("into-state/b"), "state directory"),
        ("link-itself", outside.join("into-state"), "state directory"),
        ("no-parent", outside.join("typo/b"), "does not exist"),
    ] {
        match apply(name, &to) {
            Err(RequestError::Invalid(e)) => {
                assert_eq!(e.field, "spec.to", "{name}: {e:?}");
                assert!(e.message.contains(says), "{name}: {}", e.message);
            }
            other => panic!("{name} ({}): not refused: {other:?}", to.display()),
        }
    }
    apply("fine", &outside.join("b")).expect("a target outside the state directory");
}
