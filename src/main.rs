//! The `handoffs` binary. The commands of SPEC §5 land with the engine; until then it answers
//! `--version` and `--help`, and refuses anything else as a usage error.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--version" | "-V") => {
            println!("handoffs {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        None | Some("--help" | "-h" | "help") => {
            println!(
                "handoffs {}: exactly-once delivery of handoffs between AI coding agents\n\n\
                 Usage: handoffs [--version] [--help]\n\n\
                 The delivery rules are checked by `cargo test --package model`.",
                env!("CARGO_PKG_VERSION")
            );
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("handoffs: unknown command {other:?}; see `handoffs --help`");
            ExitCode::from(2)
        }
    }
}
