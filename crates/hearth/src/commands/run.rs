//! `hearth run IMAGE`: one command from an OCI image reference to a running
//! VM, as `ignite run` is. Everything it makes is an ordinary object
//! (`NAME-image` unless a Ready image of the same reference exists,
//! `NAME-root`, `NAME-net` unless `--network` names one, `NAME`), so `get`,
//! `describe` and `delete` show them. See docs/images.md.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use hearth_api::ignite::{AUTHORIZED_KEYS, normalize_reference, parse_size};
use hearth_api::{API_VERSION, Kind, Quantity};
use serde_json::{Value, json};

use super::wait::{WaitFor, parse_duration};
use super::watch::{Follow, Goal, Target, watch};
use crate::client::ApiClient;
use crate::output::str_at;
use crate::progress;

#[derive(Debug, clap::Args)]
#[command(
    about = "Run a VM from an OCI image: pull it, make its disk, start it",
    after_help = "\
IMAGE is an OCI image reference. A short Docker Hub name works as Docker
reads it (weaveworks/ignite-ubuntu is docker.io/weaveworks/ignite-ubuntu:latest);
HOST[:PORT]/REPO:TAG pulls from that registry (trust for a private registry,
its CA or plain http, is hearthd's --registry-ca / --registry-insecure).
The image is a container filesystem (shape rootfs): hearth builds an ext4
disk from it, grows it to --size and writes the --copy-file files and the
ssh key into it.

The kernel: the one under /boot in the image itself, or --kernel-image REF
(an image holding /boot/vmlinuz, as Ignite's kernel images do).

What it makes, as ordinary objects (`hearth get`, `describe`, `delete`):
  VirtualImage   NAME-image  (reused: any Ready image of the same reference)
  VirtualDisk    NAME-root
  VirtualNetwork NAME-net    (NAT; not made with --network)
  VirtualMachine NAME

It shows the pull's progress, waits for the VM's guest agent, then says
how to log in. --ssh makes an ed25519 key for the VM (ssh-keygen) under
~/.local/share/hearth/ssh/ and puts its public key in
/root/.ssh/authorized_keys (mode 0600); --ssh=KEY.pub uses yours.

Examples:
  hearth run weaveworks/ignite-ubuntu --cpus 2 --memory 1GB --ssh
  hearth run 127.0.0.1:5000/vm/debian:12 --name web -p 8080:80 --size 8GB
  hearth run registry.local/rootfs:1 --kernel-image registry.local/kernel:6.1 \\
      --copy-file ./app.conf:/etc/app.conf --ssh=~/.ssh/id_ed25519.pub"
)]
pub struct Args {
    /// The OCI image reference.
    #[arg(value_name = "IMAGE")]
    pub image: String,
    /// The VM's name (and the prefix of its objects); from the image's
    /// repository name when left out.
    #[arg(long, value_parser = super::parse_name)]
    pub name: Option<String>,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cpus: u32,
    /// Memory: 512MB, 1GB (Ignite's units, powers of 1024) or 512Mi.
    #[arg(long, default_value = "512MB", value_parser = parse_bytes)]
    pub memory: u64,
    /// The root disk's size: 4GB, 10GB or 8Gi.
    #[arg(long, default_value = "4GB", value_parser = parse_bytes)]
    pub size: u64,
    /// An OCI image whose /boot holds the kernel to boot.
    #[arg(long, value_name = "REF")]
    pub kernel_image: Option<String>,
    /// An existing VirtualNetwork to attach to instead of a NAT network of
    /// the VM's own.
    #[arg(long, value_name = "NET", value_parser = super::parse_name)]
    pub network: Option<String>,
    /// Forward a host port to the guest: [ADDR:]HOST:GUEST[/udp]. Repeatable.
    #[arg(short = 'p', long = "port", value_name = "HOST:GUEST", value_parser = parse_port)]
    pub ports: Vec<Value>,
    /// Log in with ssh: make a key for the VM, or give a public key file.
    #[arg(long, value_name = "KEY.pub", num_args = 0..=1, require_equals = true,
          default_missing_value = "")]
    pub ssh: Option<String>,
    /// Copy a host file into the VM's disk: SRC:DST. Repeatable.
    #[arg(long = "copy-file", value_name = "SRC:DST", value_parser = parse_copy)]
    pub copy_files: Vec<(PathBuf, PathBuf)>,
    /// Give up waiting after this long (the objects stay; hearthd goes on).
    #[arg(long, value_name = "DURATION", default_value = "20m", value_parser = parse_duration)]
    pub timeout: Duration,
}

/// Ignite's sizes (`512MB`), or hearth's quantities (`512Mi`).
fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size(s).or_else(|e| Quantity::parse(s).map(|q| q.bytes()).map_err(|_| e))
}

/// `[ADDR:]HOST:GUEST[/tcp|/udp]` as a port forward.
fn parse_port(s: &str) -> Result<Value, String> {
    let bad = || format!("{s:?} is not [ADDR:]HOST:GUEST[/udp], such as 8080:80");
    let (spec, proto) = match s.rsplit_once('/') {
        Some((p, "udp")) => (p, "UDP"),
        Some((p, "tcp")) => (p, "TCP"),
        Some(_) => return Err(bad()),
        None => (s, "TCP"),
    };
    let parts: Vec<&str> = spec.split(':').collect();
    let (addr, host, guest) = match parts.as_slice() {
        [h, g] => (None, *h, *g),
        [a, h, g] => (Some(*a), *h, *g),
        _ => return Err(bad()),
    };
    let port = |p: &str| p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(bad);
    let mut fwd = json!({"hostPort": port(host)?, "guestPort": port(guest)?, "protocol": proto});
    if let Some(a) = addr {
        a.parse::<std::net::Ipv4Addr>().map_err(|_| bad())?;
        fwd["hostAddress"] = json!(a);
    }
    Ok(fwd)
}

fn parse_copy(s: &str) -> Result<(PathBuf, PathBuf), String> {
    let (src, dst) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?} is not SRC:DST"))?;
    if src.is_empty() || !dst.starts_with('/') {
        return Err(format!(
            "{s:?}: SRC is a host file, DST an absolute path in the VM"
        ));
    }
    Ok((PathBuf::from(src), PathBuf::from(dst)))
}

/// The VM's name from the image: `docker.io/weaveworks/ignite-ubuntu:latest`
/// is `ignite-ubuntu`.
pub fn name_from_image(reference: &str) -> String {
    let repo = reference.split(['@']).next().unwrap_or(reference);
    let last = repo.rsplit('/').next().unwrap_or(repo);
    let last = last.split(':').next().unwrap_or(last);
    let mut name: String = last
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    name.truncate(50);
    let name = name.trim_matches('-').to_string();
    if name.is_empty() { "vm".into() } else { name }
}

/// A Ready image of this reference, to reuse instead of pulling again.
pub fn ready_image(images: &Value, reference: &str) -> Option<String> {
    images.get("items")?.as_array()?.iter().find_map(|i| {
        let same = str_at(i, &["spec", "source", "oci", "reference"]) == Some(reference);
        let ready = str_at(i, &["status", "phase"]) == Some("Ready");
        (same && ready).then(|| str_at(i, &["metadata", "name"]).map(str::to_string))?
    })
}

/// Everything `run` applies. `public_key`: the text for authorized_keys.
pub fn plan(
    args: &Args,
    name: &str,
    image_name: Option<&str>,
    kernel_name: Option<&str>,
    public_key: Option<&str>,
) -> anyhow::Result<Vec<Value>> {
    let obj = |kind: Kind, n: &str, spec: Value| json!({"apiVersion": API_VERSION, "kind": kind.as_str(), "metadata": {"name": n}, "spec": spec});
    let oci = |r: &str| json!({"source": {"oci": {"reference": normalize_reference(r), "shape": "rootfs"}}});
    let mut out = Vec::new();
    let image = match image_name {
        Some(existing) => existing.to_string(),
        None => {
            let n = format!("{name}-image");
            out.push(obj(Kind::VirtualImage, &n, oci(&args.image)));
            n
        }
    };
    let mut boot = json!({});
    if let Some(r) = &args.kernel_image {
        let n = match kernel_name {
            Some(existing) => existing.to_string(),
            None => {
                let n = format!("{name}-kernel");
                out.push(obj(Kind::VirtualImage, &n, oci(r)));
                n
            }
        };
        boot["kernelImage"] = json!(n);
    }
    let mut files = Vec::new();
    for (src, dst) in &args.copy_files {
        let src = std::path::absolute(src).with_context(|| src.display().to_string())?;
        files.push(json!({"path": dst, "source": src}));
    }
    if let Some(key) = public_key {
        files.push(json!({"path": AUTHORIZED_KEYS, "content": format!("{}\n", key.trim_end()), "mode": "0600"}));
    }
    let disk = format!("{name}-root");
    let mut disk_spec = json!({"size": Quantity::from_bytes(args.size).to_string(), "source": {"virtualImage": image}});
    if !files.is_empty() {
        disk_spec["files"] = Value::Array(files);
    }
    out.push(obj(Kind::VirtualDisk, &disk, disk_spec));
    let net = match &args.network {
        Some(n) => n.clone(),
        None => {
            let n = format!("{name}-net");
            out.push(obj(Kind::VirtualNetwork, &n, json!({"mode": "NAT"})));
            n
        }
    };
    let mut nic = json!({"virtualNetworkName": net});
    if !args.ports.is_empty() {
        nic["ports"] = Value::Array(args.ports.clone());
    }
    out.push(obj(
        Kind::VirtualMachine,
        name,
        json!({
            "cpus": args.cpus,
            "memory": Quantity::from_bytes(args.memory).to_string(),
            "boot": boot,
            "disks": [{"virtualDiskName": disk}],
            "networks": [nic],
        }),
    ));
    // Checked here as hearthd will, so a mistake is named before anything is sent.
    for o in &out {
        hearth_api::object_from_value(o.clone(), "hearth run")
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(out)
}

/// Where `--ssh` keeps the key it makes for VM `name`.
pub fn key_path(name: &str) -> anyhow::Result<PathBuf> {
    let base = match std::env::var_os("XDG_DATA_HOME") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => {
            PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?).join(".local/share")
        }
    };
    Ok(base.join("hearth/ssh").join(format!("id_{name}")))
}

/// Makes an ed25519 key pair at `path` (kept when it is there already), and
/// returns the public key.
fn make_key(path: &Path, name: &str) -> anyhow::Result<String> {
    let public = path.with_extension("pub");
    if !path.exists() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        }
        let status = std::process::Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C"])
            .arg(format!("hearth-{name}"))
            .arg("-f")
            .arg(path)
            .status()
            .context("running ssh-keygen (from OpenSSH) to make the VM's key")?;
        if !status.success() {
            bail!("ssh-keygen failed ({status}) making {}", path.display());
        }
    }
    std::fs::read_to_string(&public).with_context(|| public.display().to_string())
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let reference = normalize_reference(&args.image);
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| name_from_image(&reference));
    if client
        .get(&super::object_path(Kind::VirtualMachine, &name))
        .await
        .is_ok()
    {
        bail!(
            "VirtualMachine {name:?} exists already; pick another with --name (or `hearth delete vm {name}`)"
        );
    }
    let images = client.get("/v1/virtualimages").await?;
    let image_name = ready_image(&images, &reference);
    let kernel_name = args
        .kernel_image
        .as_deref()
        .and_then(|k| ready_image(&images, &normalize_reference(k)));
    let (public_key, key_file) = match args.ssh.as_deref() {
        None => (None, None),
        Some("") => {
            let path = key_path(&name)?;
            (Some(make_key(&path, &name)?), Some(path))
        }
        Some(pub_file) => {
            let p = shellexpand_home(pub_file);
            let text = std::fs::read_to_string(&p).with_context(|| p.display().to_string())?;
            (Some(text), None)
        }
    };
    let items = plan(
        args,
        &name,
        image_name.as_deref(),
        kernel_name.as_deref(),
        public_key.as_deref(),
    )?;
    if let Some(i) = &image_name {
        println!("image {reference}: reusing VirtualImage {i:?} (Ready)");
    }
    let answer = client
        .post("/v1/apply", Some(&json!({ "items": items })))
        .await?;
    print!("{}", super::apply::render_results(&answer)?);
    let mut targets = super::apply::settle_targets(&answer)?;
    targets.push(Target {
        kind: Kind::VirtualMachine,
        name: name.clone(),
        goal: Goal::Condition(WaitFor::Agent),
    });
    let mut reporter = progress::for_this_process();
    watch(
        client,
        targets,
        args.timeout,
        Follow::Stream,
        reporter.as_mut(),
    )
    .await?;
    println!("VirtualMachine {name:?} is running, its guest agent answers.");
    match key_file {
        Some(k) => println!("Log in:  hearth ssh {name} -l root -i {}", k.display()),
        None if public_key.is_some() => println!("Log in:  hearth ssh {name} -l root"),
        None => println!("Log in:  hearth console {name}   (or run again with --ssh)"),
    }
    println!("Remove:  hearth delete vm {name}");
    Ok(())
}

fn shellexpand_home(p: &str) -> PathBuf {
    match (p.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: Args,
    }

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        Cli::try_parse_from(std::iter::once("run").chain(argv.iter().copied())).map(|c| c.run)
    }

    #[test]
    fn ignites_own_command_line_parses() {
        let a = parse(&[
            "weaveworks/ignite-ubuntu",
            "--cpus",
            "2",
            "--memory",
            "1GB",
            "--ssh",
        ])
        .unwrap();
        assert_eq!(a.cpus, 2);
        assert_eq!(a.memory, 1 << 30);
        assert_eq!(a.size, 4 << 30);
        assert_eq!(a.ssh.as_deref(), Some(""));
        let a = parse(&[
            "img",
            "--ssh=/k.pub",
            "-p",
            "8080:80",
            "-p",
            "127.0.0.1:53:53/udp",
            "--copy-file",
            "a.conf:/etc/a.conf",
            "--size",
            "8Gi",
            "--name",
            "web",
        ])
        .unwrap();
        assert_eq!(a.ssh.as_deref(), Some("/k.pub"));
        assert_eq!(
            a.ports[0],
            json!({"hostPort": 8080, "guestPort": 80, "protocol": "TCP"})
        );
        assert_eq!(a.ports[1]["hostAddress"], "127.0.0.1");
        assert_eq!(a.ports[1]["protocol"], "UDP");
        assert_eq!(a.copy_files[0].1, PathBuf::from("/etc/a.conf"));
        assert_eq!(a.size, 8 << 30);
        assert!(parse(&["img", "--memory", "lots"]).is_err());
        assert!(parse(&["img", "-p", "80"]).is_err());
        assert!(parse(&["img", "--copy-file", "a:relative"]).is_err());
        assert!(parse(&["img", "--name", "Bad_Name"]).is_err());
        assert!(parse(&["img", "--cpus", "0"]).is_err());
    }

    #[test]
    fn names_come_from_the_repository() {
        assert_eq!(
            name_from_image("docker.io/weaveworks/ignite-ubuntu:latest"),
            "ignite-ubuntu"
        );
        assert_eq!(name_from_image("127.0.0.1:5000/vm/Deb_ian:12"), "deb-ian");
        assert_eq!(name_from_image("a/b@sha256:00"), "b");
    }

    #[test]
    fn the_plan_is_ordinary_objects() {
        let a = parse(&[
            "weaveworks/ignite-ubuntu",
            "--kernel-image",
            "k/kern:1",
            "-p",
            "2222:22",
        ])
        .unwrap();
        let objs = plan(&a, "u", None, None, Some("ssh-ed25519 AAAA u")).unwrap();
        let kinds: Vec<&str> = objs.iter().map(|o| o["kind"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "VirtualImage",
                "VirtualImage",
                "VirtualDisk",
                "VirtualNetwork",
                "VirtualMachine"
            ]
        );
        assert_eq!(
            objs[0]["spec"]["source"]["oci"]["reference"],
            "docker.io/weaveworks/ignite-ubuntu:latest"
        );
        assert_eq!(objs[2]["spec"]["files"][0]["path"], AUTHORIZED_KEYS);
        assert_eq!(objs[2]["spec"]["files"][0]["mode"], "0600");
        assert_eq!(
            objs[2]["spec"]["files"][0]["content"],
            "ssh-ed25519 AAAA u\n"
        );
        assert_eq!(objs[4]["spec"]["boot"]["kernelImage"], "u-kernel");
        assert_eq!(objs[4]["spec"]["memory"], "512Mi");
        // A Ready image of the same reference is reused, not pulled again.
        let a = parse(&["img", "--network", "lan"]).unwrap();
        let objs = plan(&a, "v", Some("shared"), None, None).unwrap();
        let kinds: Vec<&str> = objs.iter().map(|o| o["kind"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["VirtualDisk", "VirtualMachine"]);
        assert_eq!(objs[0]["spec"]["source"]["virtualImage"], "shared");
        assert_eq!(objs[1]["spec"]["networks"][0]["virtualNetworkName"], "lan");
    }

    #[test]
    fn a_ready_image_of_the_reference_is_found() {
        let images = json!({"items": [
            {"metadata": {"name": "a"}, "spec": {"source": {"oci": {"reference": "r/x:1"}}}, "status": {"phase": "Importing"}},
            {"metadata": {"name": "b"}, "spec": {"source": {"oci": {"reference": "r/x:1"}}}, "status": {"phase": "Ready"}},
        ]});
        assert_eq!(ready_image(&images, "r/x:1").as_deref(), Some("b"));
        assert_eq!(ready_image(&images, "r/x:2"), None);
    }
}
