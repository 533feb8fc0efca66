//! The deployment files agree with the binary: `compose.yaml` runs only commands and flags
//! that exist, `server.json` has the shape the MCP registry's schema asks for and describes
//! the real stdio and HTTP forms, and the Dockerfile's image runs the binary it built. (No
//! Docker daemon here: the image itself is not built by the tests.)

use serde_json::Value;
use std::process::Command;

fn repo_file(name: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_handoffs"))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "handoffs {} --help: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn compose_runs_only_commands_and_flags_that_exist() {
    let compose = repo_file("compose.yaml");
    let mut seen = 0;
    for line in compose.lines() {
        let Some(list) = line.trim().strip_prefix("command: ") else {
            continue;
        };
        let words: Vec<String> = serde_json::from_str(list)
            .unwrap_or_else(|e| panic!("a command as a JSON list: {list}: {e}"));
        let text = help(&[words[0].as_str()]);
        for flag in words.iter().filter(|w| w.starts_with("--")) {
            assert!(
                text.contains(flag.as_str()),
                "handoffs {} has no {flag}",
                words[0]
            );
        }
        seen += 1;
    }
    assert!(seen >= 4, "the team, two engines and the cli: {seen}");
    // The page answers connections through the published port, which arrive from the
    // network's gateway: the address `team` allows must be that gateway.
    let gateway = compose
        .lines()
        .find_map(|l| l.trim().strip_prefix("gateway: "))
        .expect("the network's gateway is fixed");
    assert!(
        compose.contains(&format!("\"--allow-peer\", \"{gateway}\"")),
        "team's page answers the gateway {gateway}"
    );
    assert!(compose.contains("HANDOFFS_DB: postgres://"));
    assert!(help(&["run"]).contains("[env: HANDOFFS_DB]"));
}

#[test]
fn server_json_has_the_registry_shape_and_names_real_commands() {
    let s: Value = serde_json::from_str(&repo_file("server.json")).unwrap();
    let name = s["name"].as_str().unwrap();
    let (namespace, server) = name.split_once('/').expect("namespace/name");
    assert!(!server.contains('/'), "exactly one slash: {name}");
    let ok = |part: &str, extra: &str| {
        !part.is_empty()
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || extra.contains(c))
    };
    assert!(ok(namespace, "") && ok(server, "_"), "{name}");
    let description = s["description"].as_str().unwrap();
    assert!(
        (1..=100).contains(&description.chars().count()),
        "{description}"
    );
    for version in [&s["version"], &s["packages"][0]["version"]] {
        let v = version.as_str().unwrap();
        assert!(!v.is_empty() && v != "latest", "{v}");
    }
    assert!(
        s["$schema"]
            .as_str()
            .unwrap()
            .ends_with("/server.schema.json")
    );

    let package = &s["packages"][0];
    for key in ["registryType", "identifier", "version", "transport"] {
        assert!(!package[key].is_null(), "a package needs {key}");
    }
    assert_eq!(package["transport"]["type"], "stdio");
    for arg in package["runtimeArguments"]
        .as_array()
        .unwrap()
        .iter()
        .chain(package["packageArguments"].as_array().unwrap())
    {
        match arg["type"].as_str() {
            Some("named") => assert!(arg["name"].is_string(), "{arg}"),
            Some("positional") => {
                assert!(
                    arg["value"].is_string() || arg["valueHint"].is_string(),
                    "{arg}"
                );
            }
            other => panic!("an argument's type: {other:?}"),
        }
    }
    // The stdio form runs `handoffs mcp --agent ID` with the database in HANDOFFS_DB.
    let words: Vec<&str> = package["packageArguments"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a["value"].as_str().or_else(|| a["name"].as_str()))
        .collect();
    assert_eq!(words, ["mcp", "--agent"]);
    let mcp = help(&["mcp"]);
    assert!(
        mcp.contains("--agent") && mcp.contains("[env: HANDOFFS_DB]"),
        "{mcp}"
    );
    let env = &package["environmentVariables"][0];
    assert_eq!(env["name"], "HANDOFFS_DB");
    assert_eq!(env["isSecret"], true, "a database URL may hold a password");

    // The HTTP form: `serve`'s /mcp with an agent's bearer token.
    let remote = &s["remotes"][0];
    assert_eq!(remote["type"], "streamable-http");
    assert!(remote["url"].as_str().unwrap().ends_with("/mcp"));
    assert_eq!(remote["headers"][0]["name"], "Authorization");
    assert!(help(&["serve"]).contains("--allow-host"));
    assert!(help(&["agent", "token"]).contains("Usage"));

    // The image the Dockerfile builds carries the name the registry matches it by.
    let dockerfile = repo_file("Dockerfile");
    assert!(
        dockerfile.contains(&format!("io.modelcontextprotocol.server.name=\"{name}\"")),
        "the Dockerfile's label names {name}"
    );
}

#[test]
fn the_image_runs_the_binary_it_built() {
    let dockerfile = repo_file("Dockerfile");
    let lines: Vec<&str> = dockerfile.lines().collect();
    let stages = lines.iter().filter(|l| l.starts_with("FROM ")).count();
    assert_eq!(stages, 2, "a build stage and a runtime stage");
    assert!(dockerfile.contains("cargo build --release --locked --bin handoffs"));
    let copy = lines
        .iter()
        .find(|l| l.starts_with("COPY --from=build"))
        .expect("the binary copied from the build stage");
    let target = copy.split_whitespace().last().unwrap();
    assert!(
        dockerfile.contains(&format!("ENTRYPOINT [\"{target}\"]")),
        "the entry point is the copied binary {target}"
    );
    let user = lines
        .iter()
        .find(|l| l.starts_with("USER "))
        .expect("a user");
    let name = user["USER ".len()..].split(':').next().unwrap();
    assert!(name != "root" && name != "0", "not root: {user}");
    // Every folder compose.yaml mounts a volume at is made in the image, the user's own
    // (`nonroot` is 65532 in the distroless image): Docker fills a new named volume from
    // the image's folder, owner included, and would otherwise make it root's, where the
    // state folder cannot be made private (podman gives a new volume to the user instead).
    assert!(dockerfile.contains("USER nonroot:nonroot"), "{user}");
    let compose = repo_file("compose.yaml");
    let mounts: std::collections::BTreeSet<&str> = compose
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- state-"))
        .filter_map(|m| m.split(':').nth(1))
        .collect();
    assert!(!mounts.is_empty(), "compose.yaml mounts the state volumes");
    let (made, home) = lines
        .iter()
        .find_map(|l| l.strip_prefix("COPY --from=build --chown=65532:65532 "))
        .and_then(|l| l.split_once(' '))
        .expect("a folder copied from the build stage as the user's own");
    for path in mounts {
        let name = path
            .strip_prefix(home)
            .unwrap_or_else(|| panic!("{path}, compose.yaml's volume, is under {home}"));
        assert!(
            dockerfile.contains(&format!("mkdir -p {made}{name}")),
            "the image makes {path}, compose.yaml's volume, its user's own"
        );
        assert!(
            dockerfile.contains(&format!("HANDOFFS_STATE_DIR={path}")),
            "the state folder is {path}"
        );
    }
    // The build stage's Rust is the one this workspace builds with.
    let toolchain = lines
        .iter()
        .find_map(|l| l.strip_prefix("FROM rust:"))
        .and_then(|t| t.split('-').next())
        .unwrap();
    let rustc = Command::new("rustc").arg("--version").output().unwrap();
    let here = String::from_utf8_lossy(&rustc.stdout).into_owned();
    assert!(
        here.starts_with(&format!("rustc {toolchain}")),
        "the image builds with Rust {toolchain}, this workspace with {here}"
    );
}
