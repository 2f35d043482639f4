use super::*;

#[test]
fn output_len_parses() {
    assert_eq!(
        "max-tokens".parse(),
        Ok(OutputLen::MaxTokens { default: 128 })
    );
    assert_eq!(
        "max-tokens:7".parse(),
        Ok(OutputLen::MaxTokens { default: 7 })
    );
    assert_eq!("fixed:3".parse(), Ok(OutputLen::Fixed(3)));
    assert_eq!(
        "uniform:2-9".parse(),
        Ok(OutputLen::Uniform { min: 2, max: 9 })
    );
    assert_eq!(
        "geometric:50".parse(),
        Ok(OutputLen::Geometric { mean: 50.0 })
    );
    assert!("uniform:9-2".parse::<OutputLen>().is_err());
    assert!("geometric:0.5".parse::<OutputLen>().is_err());
    assert!("poisson:3".parse::<OutputLen>().is_err());
}

#[test]
fn calibrated_step_times() {
    let l = LatencyModel::default();
    // The published points the defaults were fitted to (ms).
    assert!((l.step_seconds(0, 1) * 1e3 - 5.1).abs() < 0.05);
    assert!((l.step_seconds(0, 32) * 1e3 - 7.1).abs() < 0.05);
    assert!((l.step_seconds(256, 0) * 1e3 - 27.0).abs() < 0.1);
}

#[test]
fn modes_refuse_what_their_engine_lacks() {
    let sglang = SimConfig {
        engine_mode: "sglang".parse().expect("mode"),
        ..SimConfig::default()
    };
    assert!(sglang.validate().is_ok());
    let mut c = sglang.clone();
    c.engine.hash_seed = HashSeed::Fixed("0".to_owned());
    assert!(c.validate().unwrap_err().to_string().contains("hash seed"));
    let mut c = sglang.clone();
    c.admission.max_num_queued_reqs = Some(4);
    assert!(c.validate().unwrap_err().to_string().contains("admission"));
    let mut c = SimConfig {
        engine_mode: "vllm:0.28".parse().expect("mode"),
        ..SimConfig::default()
    };
    c.faults.fail_requests = FailMode::AdmissionReject;
    assert!(c.validate().is_err());
    c.faults.fail_requests = FailMode::CudaError;
    c.faults.fail_fraction = 0.0;
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .contains("fail_fraction")
    );
    assert_eq!("cuda-error".parse(), Ok(FailMode::CudaError));
    assert_eq!("random".parse(), Ok(HashSeed::Random));
    assert_eq!("7".parse(), Ok(HashSeed::Fixed("7".to_owned())));
}

#[test]
fn lora_modules_parse_and_validate() {
    assert_eq!(
        "sql=/models/sql-lora".parse(),
        Ok(LoraModule::new("sql", "/models/sql-lora"))
    );
    assert_eq!(
        " chat ".parse(),
        Ok(LoraModule::new("chat", "/adapters/chat"))
    );
    assert!("=/p".parse::<LoraModule>().is_err());
    assert!(
        "x=".parse::<LoraModule>()
            .unwrap_err()
            .contains("empty path")
    );
    let with = |modules: &[&str]| SimConfig {
        aliases: vec!["alias".to_owned()],
        lora: LoraConfig {
            modules: modules.iter().map(|m| m.parse().expect("module")).collect(),
            ..LoraConfig::default()
        },
        ..SimConfig::default()
    };
    let c = with(&["a", "b=/x"]);
    assert!(c.validate().is_ok());
    assert_eq!((c.lora.id_of("a"), c.lora.id_of("b")), (Some(1), Some(2)));
    assert_eq!(c.lora.module(2).map(|m| m.path.as_str()), Some("/x"));
    assert!(c.lora.id_of("kinference/sim").is_none() && c.lora.module(0).is_none());
    let err = |c: SimConfig| c.validate().unwrap_err().to_string();
    assert!(err(with(&["a", "a=/y"])).contains("listed twice"));
    assert!(err(with(&["kinference/sim"])).contains("base model"));
    assert!(err(with(&["alias"])).contains("base model"));
    let mut c = with(&["a"]);
    c.lora.max_loras = 0;
    assert!(err(c).contains("max_loras"));
    let mut c = with(&["a"]);
    c.lora.load_ms = f64::NAN;
    assert!(err(c).contains("lora_load_ms"));
    let mut c = with(&["a"]);
    c.lora.modules[0].name = "a,b".to_owned();
    assert!(err(c).contains("comma"));
    let mut c = with(&["a"]);
    c.engine_mode = "sglang".parse().expect("mode");
    assert!(err(c).contains("LoRA"));
    // Without adapters, the LoRA settings are harmless everywhere.
    let sglang = SimConfig {
        engine_mode: "sglang".parse().expect("mode"),
        ..SimConfig::default()
    };
    assert!(sglang.validate().is_ok());
}

#[test]
fn validation_names_the_problem() {
    let mut c = SimConfig::default();
    assert!(c.validate().is_ok());
    c.engine.num_gpu_blocks = 1;
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .contains("num_gpu_blocks")
    );
}
