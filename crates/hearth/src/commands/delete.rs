//! `hearth delete KIND NAME...`: remove objects created through the API.

use std::io::Write;

use anyhow::bail;
use hearth_api::Kind;

use super::{object_path, resource_ref};
use crate::client::ApiClient;

#[derive(Debug, clap::Args)]
#[command(
    about = "Delete objects; a VM is stopped first, a disk or an image must not be in use",
    after_help = "\
Objects that come from the manifest directory cannot be deleted here:
remove their file instead. An image that disks were made from is refused
with the names of those disks (delete the disks first); the command then
prints hearthd's message and exits 1. Deleting a snapshot frees its space once nothing
needs it any more (a disk created from it, or a later snapshot, keeps what it
reads); no other snapshot or disk changes content. It is safe while a cut is
in progress.

Examples:
  hearth delete vm demo
  hearth delete disk data scratch
  hearth delete image debian-12
  hearth delete snapshot data-20250101-120000
  hearth delete vmsnapshot before-upgrade"
)]
pub struct Args {
    #[arg(value_name = "KIND", value_parser = super::parse_kind, help = super::KIND_HELP)]
    pub kind: Kind,
    /// One or more names; each is deleted on its own, so one failure does not stop the rest.
    #[arg(value_name = "NAME", required = true, value_parser = super::parse_name)]
    pub names: Vec<String>,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    delete(client, args, &mut std::io::stdout().lock()).await
}

pub async fn delete(client: &ApiClient, args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    // One name: its error is the error. Several: report each, go on, sum up.
    if let [name] = args.names.as_slice() {
        return delete_one(client, args.kind, name, out).await;
    }
    let mut failed = 0usize;
    for name in &args.names {
        if let Err(e) = delete_one(client, args.kind, name, out).await {
            failed += 1;
            eprintln!("error: {e:#}");
        }
    }
    if failed > 0 {
        bail!("{failed} of {} deletions failed", args.names.len());
    }
    Ok(())
}

async fn delete_one(
    client: &ApiClient,
    kind: Kind,
    name: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    client.delete(&object_path(kind, name)).await?;
    writeln!(out, "{} deleted", resource_ref(kind.as_str(), name))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_server::{ScriptedServer, ok};
    use hyper::StatusCode;
    use serde_json::json;

    #[tokio::test]
    async fn deleting_snapshots_of_both_kinds_uses_their_paths() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                ok(r#"{"kind": "VirtualDiskSnapshot", "name": "s1", "action": "deleted"}"#),
                ok(r#"{"kind": "VirtualMachineSnapshot", "name": "pre", "action": "deleted"}"#),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        for (kind, name) in [
            (Kind::VirtualDiskSnapshot, "s1"),
            (Kind::VirtualMachineSnapshot, "pre"),
        ] {
            let args = Args {
                kind,
                names: vec![name.to_string()],
            };
            delete(&client, &args, &mut out).await.expect("deleted");
        }
        assert_eq!(
            String::from_utf8_lossy(&out),
            "virtualdisksnapshot/s1 deleted\nvirtualmachinesnapshot/pre deleted\n"
        );
        let seen = server.seen();
        assert_eq!(
            seen.iter()
                .map(|s| format!("{} {}", s.method, s.path))
                .collect::<Vec<_>>(),
            [
                "DELETE /v1/virtualdisksnapshots/s1",
                "DELETE /v1/virtualmachinesnapshots/pre"
            ]
        );
    }

    #[tokio::test]
    async fn one_refused_deletion_does_not_stop_the_others() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                (
                    StatusCode::CONFLICT,
                    r#"{"error": "VirtualDiskSnapshot \"a\" belongs to VirtualMachineSnapshot \"pre\""}"#
                        .to_string(),
                ),
                ok(r#"{"kind": "VirtualDiskSnapshot", "name": "b", "action": "deleted"}"#),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let args = Args {
            kind: Kind::VirtualDiskSnapshot,
            names: vec!["a".into(), "b".into()],
        };
        let mut out = Vec::new();
        let err = delete(&client, &args, &mut out)
            .await
            .expect_err("one failed");
        assert_eq!(err.to_string(), "1 of 2 deletions failed");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "virtualdisksnapshot/b deleted\n"
        );
        assert_eq!(server.seen().len(), 2);
    }

    #[tokio::test]
    async fn an_image_in_use_is_refused_with_the_servers_words() {
        let dir = tempfile::tempdir().expect("tempdir");
        let refusal = "VirtualImage \"debian-12\" is in use by VirtualDisk \"web-root\", \"db-root\"; \
                       delete those disks first";
        let server = ScriptedServer::start(
            dir.path(),
            vec![(
                StatusCode::CONFLICT,
                json!({ "error": refusal }).to_string(),
            )],
        );
        let client = ApiClient::new(&server.socket);
        let args = Args {
            kind: Kind::VirtualImage,
            names: vec!["debian-12".into()],
        };
        let mut out = Vec::new();
        let err = delete(&client, &args, &mut out).await.expect_err("refused");
        // main prints this after `error: ` and exits 1.
        assert_eq!(format!("{err:#}"), refusal);
        assert!(out.is_empty());
        let seen = server.seen();
        assert_eq!(
            (seen[0].method.as_str(), seen[0].path.as_str()),
            ("DELETE", "/v1/virtualimages/debian-12")
        );
    }

    #[tokio::test]
    async fn a_deleted_image_is_reported_like_any_object() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![ok(
                r#"{"kind": "VirtualImage", "name": "old", "action": "deleted"}"#,
            )],
        );
        let client = ApiClient::new(&server.socket);
        let args = Args {
            kind: Kind::VirtualImage,
            names: vec!["old".into()],
        };
        let mut out = Vec::new();
        delete(&client, &args, &mut out).await.expect("deleted");
        assert_eq!(String::from_utf8_lossy(&out), "virtualimage/old deleted\n");
    }
}
