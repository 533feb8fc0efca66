//! What the bench binaries that start `serve` share (each includes this as `mod common`).

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The binary cargo built for this bench (the same profile and target folder).
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_handoffs"))
}

/// `handoffs serve --port 0` over `db`, run in `dir`, and its address without the page's
/// token or a trailing `/` (as `http://127.0.0.1:PORT`).
pub fn serve(db: &Path, dir: &Path) -> (Child, String) {
    let mut child = Command::new(bin())
        .args(["serve", "--port", "0"])
        .env("HANDOFFS_DB", db)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let base = first
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap()
        .split('#')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .to_owned();
    (child, base)
}
